# The installed package as a user meets it (a ctest script, see tests/CMakeLists.txt):
#   cmake --install BUILD_DIR --prefix WORK_DIR/prefix
# then checks what was installed (the public headers and no others; no build-only dependency
# in the exported interface), and configures, builds and runs tests/install against it.
# BUILD_DIR: replayssm's build; SOURCE_DIR: tests/install; WORK_DIR: scratch (emptied first);
# CXX: the C++ compiler; CONFIG: the build type.
file(REMOVE_RECURSE ${WORK_DIR})

function(run what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (${rc}):\n${out}\n${err}")
  endif()
  set(run_output "${out}" PARENT_SCOPE)
endfunction()

set(prefix ${WORK_DIR}/prefix)
run("cmake --install" ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix} --config ${CONFIG})

# The headers: include/replayssm/*.h of the source tree plus the generated version.h.
file(GLOB public RELATIVE ${SOURCE_DIR}/../../include ${SOURCE_DIR}/../../include/replayssm/*.h)
list(APPEND public replayssm/version.h)
file(GLOB_RECURSE installed RELATIVE ${prefix}/include ${prefix}/include/*)
list(SORT public)
list(SORT installed)
if(NOT installed STREQUAL public)
  message(FATAL_ERROR "installed headers: ${installed}\nexpected: ${public}")
endif()
file(GLOB_RECURSE exported ${prefix}/replayssmTargets*.cmake)
if(NOT exported)
  message(FATAL_ERROR "no replayssmTargets.cmake under ${prefix}")
endif()
foreach(file IN LISTS exported)
  file(READ ${file} text)
  if(text MATCHES "(nlohmann|CLI11|GTest)")
    message(FATAL_ERROR "${file} exports a build-only dependency (${CMAKE_MATCH_1})")
  endif()
endforeach()

set(build ${WORK_DIR}/build)
run("configure the consumer" ${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${build}
    -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_CXX_COMPILER=${CXX} -DCMAKE_BUILD_TYPE=${CONFIG})
run("build the consumer" ${CMAKE_COMMAND} --build ${build})
run("run the consumer" ${build}/consumer)
message(STATUS "${run_output}")
