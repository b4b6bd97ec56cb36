# The replayssm tool's contract beyond "one error line": what the messages say, that limits are
# checked before any work, that outputs never replace the input or leave a partial file, and
# that the quick bench and the demo run. Included from tests/CMakeLists.txt.
#
# replayssm_cli_check(<name> ok|error [MATCH regex] [TIMEOUT s] [FSIZE_BLOCKS n] [ABSENT path]
#                     [UNCHANGED file|reference] [COPY source|destination] [APPEND text]
#                     [TOOL target] ARGS <tool arguments...>)
# (cli_expect.cmake says what each one checks.) TOOL: another executable of the project instead
# of the replayssm tool, one that reports an error as one line "<target>: ..." (as
# replayssm_cuda_bench does) where the replayssm tool writes "error: ...".
function(replayssm_cli_check name expect)
  cmake_parse_arguments(arg "" "MATCH;TIMEOUT;FSIZE_BLOCKS;ABSENT;UNCHANGED;COPY;APPEND;TOOL"
                        "ARGS" ${ARGN})
  list(JOIN arg_ARGS "|" args)
  set(tool replayssm_tool)
  set(error_prefix "error: ")
  if(DEFINED arg_TOOL)
    set(tool ${arg_TOOL})
    set(error_prefix "${arg_TOOL}: ")
  endif()
  set(defines -DTOOL=$<TARGET_FILE:${tool}> -DEXPECT=${expect} "-DARGS=${args}"
              "-DERROR_PREFIX=${error_prefix}")
  foreach(key MATCH FSIZE_BLOCKS ABSENT UNCHANGED COPY APPEND)
    if(DEFINED arg_${key})
      list(APPEND defines "-D${key}=${arg_${key}}")
    endif()
  endforeach()
  add_test(NAME cli.${name}
    COMMAND ${CMAKE_COMMAND} ${defines} -P ${CMAKE_CURRENT_SOURCE_DIR}/cli_expect.cmake
    WORKING_DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR})
  set_tests_properties(cli.${name} PROPERTIES LABELS cpu)
  if(DEFINED arg_TIMEOUT)
    set_tests_properties(cli.${name} PROPERTIES TIMEOUT ${arg_TIMEOUT})
  endif()
endfunction()

set(cli_dir ${CMAKE_CURRENT_BINARY_DIR})
set(cli_trace data/mamba2_small.safetensors)
set(cli_run run --trace ${cli_trace} --out ${cli_dir}/cli_contract_out.safetensors --device cpu)

# Eager runs verify windows too (per-draft state: T + 1 state copies, the commit selects one).
replayssm_cli_check(run_eager_spec ok TIMEOUT 30 MATCH "eager T=4 on cpu: [0-9]+ decode steps"
  ARGS run --trace ${cli_trace} --out ${cli_dir}/cli_contract_eager_spec.safetensors --device cpu
       --mode eager -T 4 --accept-seed 3)

# Limits: one source (state_cache.h), checked before any work (a long run would time out),
# named as typed, shown in --help.
replayssm_cli_check(run_buffer_len_range error TIMEOUT 10
  MATCH "--buffer-len \\(-L\\) must be in \\[1, 4096\\], got 5000" ARGS ${cli_run} -L 5000)
replayssm_cli_check(run_spec_tokens_range error TIMEOUT 10
  MATCH "--spec-tokens \\(-T\\) must be in \\[1, 64\\], got 100" ARGS ${cli_run} -T 100)
replayssm_cli_check(bench_buffer_len_range error TIMEOUT 10
  MATCH "--buffer-len \\(-L\\) must be in \\[1, 4096\\], got 5000" ARGS bench --device cpu -L 5000)
replayssm_cli_check(bench_layers_cpu error TIMEOUT 10
  MATCH "layers per step other than 1: the CUDA bench only" ARGS bench --device cpu --layers 2)
replayssm_cli_check(bench_batch_range error TIMEOUT 10
  MATCH "--batch must be in \\[1, [0-9]+\\], got 0" ARGS bench --device cpu --batch 16,0)
replayssm_cli_check(bench_fold_every_above_buffer_len error TIMEOUT 10
  MATCH "fold_every must be in \\[1, L\\], or 0 for L" ARGS bench --device cpu -L 8 --fold-every 12)
# A fold cadence shorter than L: the replay rows say "F/L" and the legend explains it.
replayssm_cli_check(bench_fold_every_label ok TIMEOUT 60
  MATCH "replay fp32 +4/16 staggered.*F/L +replay decodes that fold every F tokens"
  ARGS bench --device cpu --shape qwen35-4b --batch 1 --checkpoint fp32 --fold-every 4
       --repetitions 1 --min-state-mb 8)
replayssm_cli_check(demo_buffer_len_range error TIMEOUT 10
  MATCH "--buffer-len \\(-L\\) must be in \\[1, 4096\\], got 5000" ARGS demo --device cpu -L 5000)
replayssm_cli_check(run_help_shows_ranges ok
  MATCH "tokens per fold cycle \\[1, 4096\\]" ARGS run --help)
replayssm_cli_check(demo_help_shows_ranges ok
  MATCH "Tokens per fold cycle \\[1, 4096\\]" ARGS demo --help)

# Options the chosen mode would ignore are errors.
replayssm_cli_check(eager_with_checkpoint error
  MATCH "--checkpoint applies to --mode replay only" ARGS ${cli_run} --mode eager --checkpoint fp32)
replayssm_cli_check(eager_with_buffer_len error
  MATCH "--buffer-len \\(-L\\) applies to --mode replay only" ARGS ${cli_run} --mode eager -L 8)

# The output never replaces its input (the same path, or another path to the same file).
set(cli_input ${cli_dir}/cli_contract_input.safetensors)
replayssm_cli_check(out_is_trace error MATCH "is the input trace"
  COPY "${cli_trace}|${cli_input}" UNCHANGED "${cli_input}|${cli_trace}"
  ARGS run --trace ${cli_input} --out ${cli_input} --device cpu)
replayssm_cli_check(out_is_trace_other_path error MATCH "is the input trace"
  COPY "${cli_trace}|${cli_input}" UNCHANGED "${cli_input}|${cli_trace}"
  ARGS run --trace ${cli_input} --out ${cli_dir}/./cli_contract_input.safetensors --device cpu)

# A write that fails part way (here a file size limit, as a full disk would) leaves no file.
set(cli_partial ${cli_dir}/cli_contract_partial.safetensors)
replayssm_cli_check(failed_write_leaves_no_file error MATCH "cannot write" FSIZE_BLOCKS 4
  ABSENT ${cli_partial} ARGS run --trace ${cli_trace} --out ${cli_partial} --device cpu)

# Bytes after the last tensor's data are refused (TRACE_FORMAT.md).
set(cli_trailing ${cli_dir}/cli_contract_trailing.safetensors)
replayssm_cli_check(trailing_bytes error MATCH "4 bytes follow the end of the tensors' data"
  COPY "${cli_trace}|${cli_trailing}" APPEND "junk"
  ARGS run --trace ${cli_trailing} --out ${cli_dir}/cli_contract_out.safetensors --device cpu)

# A GPU that is not there fails at once, in every subcommand.
if(NOT REPLAYSSM_ENABLE_CUDA)
  replayssm_cli_check(demo_cuda_without_cuda error TIMEOUT 5 MATCH "--device cuda"
    ARGS demo --device cuda)
endif()

# --spec-accepted: an integer in [0, T] or `random`, checked before the device (so on any
# machine). A valid value gets as far as the next check: here, that the spec bench is CUDA only.
replayssm_cli_check(bench_spec_accepted_random_parses error TIMEOUT 10
  MATCH "--spec-tokens \\(-T\\) > 1 needs --device cuda"
  ARGS bench --device cpu -T 4 --spec-accepted random)
replayssm_cli_check(bench_spec_accepted_above_window error TIMEOUT 10
  MATCH "--spec-accepted must be an integer in \\[0, 4\\] \\(at most --spec-tokens \\(-T\\), 0 = all\\) or 'random', got '9'"
  ARGS bench --device cuda -T 4 --spec-accepted 9)
replayssm_cli_check(bench_spec_accepted_not_a_number error TIMEOUT 10
  MATCH "--spec-accepted must be an integer in \\[0, 4\\] .* or 'random', got 'sometimes'"
  ARGS bench --device cuda -T 4 --spec-accepted sometimes)
replayssm_cli_check(bench_help_shows_random_acceptance ok
  MATCH "--spec-accepted INT\\|random=0.*or random: per row and step" ARGS bench --help)
if(REPLAYSSM_ENABLE_CUDA)
  # The same values in the full CUDA sweep, checked before its first case. `random` passes and
  # the run stops at the next check, an unknown shape, which comes before the GPU's.
  replayssm_cli_check(cuda_bench_spec_accepted_random_parses error TIMEOUT 10
    TOOL replayssm_cuda_bench MATCH "unknown shape 'nosuch'"
    ARGS --shapes nosuch --spec-accepted random)
  replayssm_cli_check(cuda_bench_spec_accepted_above_window error TIMEOUT 10
    TOOL replayssm_cuda_bench
    MATCH "--spec-accepted must be an integer in \\[0, 4\\] \\(at most --spec-window, 0 = all\\) or 'random', got '9'"
    ARGS --spec-window 4 --spec-accepted 9)
  replayssm_cli_check(cuda_bench_spec_accepted_not_a_number error TIMEOUT 10
    TOOL replayssm_cuda_bench MATCH "--spec-accepted must be an integer .* got 'sometimes'"
    ARGS --spec-accepted sometimes)
endif()

# The quick bench prints its table's legend; the demo checks agreement itself (it fails when
# replay is off eager by more than its tolerance) and explains the speed it measured.
replayssm_cli_check(bench_quick_legend ok TIMEOUT 120
  MATCH "us/step  median time of one decode step"
  ARGS bench --device cpu --shape qwen35-4b --batch 2 --repetitions 1 --min-state-mb 8)
replayssm_cli_check(demo_small ok TIMEOUT 120
  MATCH "replay fp32, spec T=4 +[0-9.e+-]+ +[0-9.e+-]+ +ok.*Replay was faster than eager"
  ARGS demo --device cpu --batch 2 --cycles 1 --min-state-mb 8)
