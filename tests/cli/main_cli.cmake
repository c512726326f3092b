# The main job's command line (bench/main.cpp): bad values exit with status 2 and a message
# naming the option, the expected and the actual value; --help lists the defaults; --fp32
# and --fp16 select different dtypes. Run by CTest:
#   cmake -DMAIN=<path of flashattn_main> -P main_cli.cmake
if(NOT MAIN)
  message(FATAL_ERROR "main_cli.cmake: pass -DMAIN=<flashattn_main>")
endif()

set(failures 0)

# expect(<exit status> <regex on stdout+stderr> <args...>)
function(expect status regex)
  execute_process(COMMAND "${MAIN}" ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                  ERROR_VARIABLE err TIMEOUT 120)
  set(text "${out}${err}")
  if(NOT rc STREQUAL "${status}" OR NOT text MATCHES "${regex}")
    message(SEND_ERROR "flashattn_main ${ARGN}: expected exit ${status} and output matching\n"
                       "  ${regex}\ngot exit ${rc} and:\n${text}")
  else()
    message(STATUS "ok: flashattn_main ${ARGN} -> ${rc}")
  endif()
endfunction()

expect(2 "option --seqlen: expected an integer >= 1, got 'abc'" --cpu --seqlen abc)
expect(2 "option --seqlen: expected an integer >= 1, got '0'" --cpu --seqlen 0)
expect(2 "option --seqlen: expected an integer >= 1, got '12x'" --cpu --seqlen 12x)
expect(2 "option --heads: expected an integer >= 1, got '-1'" --cpu --heads -1)
expect(2 "option --batch: expected an integer >= 1, got '0'" --cpu --batch 0)
expect(2 "option --batch: expected an integer >= 1, got '99999999999'" --cpu --batch 99999999999)
expect(2 "option --head-dim: expected an integer in \\[1, 256\\], got '300'" --cpu --head-dim 300)
expect(2 "option --repeats: expected an integer >= 1, got '0'" --cpu --repeats 0)
expect(2 "option --seqlen: expected a value after it" --cpu --seqlen)
expect(2 "unknown option '--bogus'" --cpu --bogus)
expect(2 "options --bf16, --fp16, --fp32: expected at most one, got 2" --cpu --fp16 --fp32)
expect(2 "expected sizes below 9e15 elements" --cpu --batch 2000000000 --seqlen 2000000000)
expect(0 "--seqlen N .*\\(4096 / 2048\\)" --help)
expect(0 "--head-dim N .*\\(128 / 64\\)" --help)
expect(0 "CPU: float32, batch 1, heads 1, seqlen 16, head dim 8" --cpu --fp32 --heads 1 --seqlen 16 --head-dim 8 --repeats 1)
expect(0 "CPU: float16, batch 1, heads 1, seqlen 16, head dim 8" --cpu --fp16 --heads 1 --seqlen 16 --head-dim 8 --repeats 1)
expect(0 "CPU: bfloat16, batch 1, heads 1, seqlen 16, head dim 8" --cpu --heads 1 --seqlen 16 --head-dim 8 --repeats 1)
