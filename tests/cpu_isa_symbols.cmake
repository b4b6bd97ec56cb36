# Checks the objects of the CPU backend's instruction-set variants (a ctest script, see
# tests/CMakeLists.txt): in the object of a variant built for a level above the baseline
# (src/cpu/isa.h), every replayssm function it defines lies in that variant's namespace.
# One outside it (an inline helper defined before REPLAYSSM_CPU_BEGIN, emitted out of line)
# runs the baseline target's code inside the variant's loops: move it into the variant's
# code, or make sure it inlines. NM: the nm tool; OBJECTS: replayssm's objects, "|"-separated.
string(REPLACE "|" ";" objects "${OBJECTS}")
set(checked 0)
foreach(object IN LISTS objects)
  if(NOT object MATCHES "/cpu_isa/(x86_64_v[0-9])/")
    continue()
  endif()
  set(ns ${CMAKE_MATCH_1})
  execute_process(COMMAND ${NM} -C --defined-only ${object}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE symbols ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${NM} ${object}: ${err}")
  endif()
  string(REPLACE "\n" ";" lines "${symbols}")
  foreach(line IN LISTS lines)
    # Global (T) and weak (W) functions: local ones belong to this object alone.
    if(line MATCHES "^[0-9a-f]+ [TW] (replayssm::.*)$")
      if(NOT CMAKE_MATCH_1 MATCHES "^replayssm::cpu::${ns}::")
        message(FATAL_ERROR "${object} defines ${CMAKE_MATCH_1} outside replayssm::cpu::${ns}")
      endif()
    endif()
  endforeach()
  math(EXPR checked "${checked} + 1")
endforeach()
if(checked EQUAL 0)
  message(STATUS "no x86-64 level variants in this build: nothing to check")
endif()
message(STATUS "${checked} variant objects checked")
