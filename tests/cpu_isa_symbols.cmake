# Checks the objects of the CPU backend's instruction-set variants (a ctest script, see
# tests/CMakeLists.txt): in the object of a variant built for a level above the baseline
# (src/cpu/isa.h), every replayssm function it defines lies in that variant's namespace.
# One outside it (an inline helper defined before REPLAYSSM_CPU_BEGIN, emitted out of line)
# runs the baseline target's code inside the variant's loops: move it into the variant's
# code, or make sure it inlines. NM: the nm tool; OBJECTS: replayssm's objects, "|"-separated.
cmake_policy(VERSION 3.24)
string(REPLACE "|" ";" objects "${OBJECTS}")
set(checked 0)
foreach(object IN LISTS objects)
  if(NOT object MATCHES "/cpu_isa/(x86_64_v[0-9])/")
    continue()
  endif()
  set(ns ${CMAKE_MATCH_1})
  string(LENGTH ${ns} ns_length)
  # Mangled names say where a function lies whatever its return type; the demangled list, in
  # the same order, names it in the message.
  foreach(form mangled demangled)
    set(flags --defined-only)
    if(form STREQUAL "demangled")
      list(APPEND flags -C)
    endif()
    execute_process(COMMAND ${NM} ${flags} ${object}
                    RESULT_VARIABLE rc OUTPUT_VARIABLE symbols ERROR_VARIABLE err)
    if(NOT rc EQUAL 0)
      message(FATAL_ERROR "${NM} ${object}: ${err}")
    endif()
    string(REPLACE "\n" ";" ${form} "${symbols}")
  endforeach()
  set(i 0)
  foreach(line IN LISTS mangled)
    # Global (T) and weak (W) functions in namespace replayssm (_ZN, const or not, 9replayssm);
    # local ones belong to this object alone.
    if(line MATCHES "^[0-9a-f]+ [TW] _ZN[KVrO]*9replayssm"
       AND NOT line MATCHES "^[0-9a-f]+ [TW] _ZN[KVrO]*9replayssm3cpu${ns_length}${ns}")
      list(GET demangled ${i} name)
      string(REGEX REPLACE "^[0-9a-f]+ [TW] " "" name "${name}")
      message(FATAL_ERROR "${object} defines a function outside replayssm::cpu::${ns}: ${name}")
    endif()
    math(EXPR i "${i} + 1")
  endforeach()
  math(EXPR checked "${checked} + 1")
endforeach()
if(checked EQUAL 0)
  message(STATUS "no x86-64 level variants in this build: nothing to check")
endif()
message(STATUS "${checked} variant objects checked")
