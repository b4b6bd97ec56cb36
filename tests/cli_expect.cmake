# Runs the replayssm tool and checks its command-line contract (ctest script, see
# tests/CMakeLists.txt). TOOL: the executable; ARGS: its arguments joined by "|";
# EXPECT=ok: exit 0. EXPECT=error: a non-zero exit and stderr exactly one line "error: ...",
# which also fails a crash (no such line).
string(REPLACE "|" ";" args "${ARGS}")
execute_process(COMMAND "${TOOL}" ${args} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(EXPECT STREQUAL "ok")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "expected success, got exit '${rc}': ${err}")
  endif()
else()
  if(rc EQUAL 0)
    message(FATAL_ERROR "expected an error, got success: ${out}")
  endif()
  if(NOT err MATCHES "^error: [^\n]+\n$")
    message(FATAL_ERROR "expected one 'error: ...' line on stderr (exit '${rc}'), got: ${err}")
  endif()
endif()
