# Sourced by the device scripts (scripts/*_gpu.sh): one line for a gtest run's outcome.
#   gtest_state LOG RC LIMIT   ->  "ok, N passed, M skipped" | "TIMEOUT after LIMITs (last started: T)"
#                                  | "FAILED rc RC, N passed: the failed tests"
gtest_state() {
  local log=$1 rc=$2 limit=$3 passed skipped failed
  passed=$(grep -oE '^\[  PASSED  \] [0-9]+' "$log" | grep -oE '[0-9]+$' || true)
  skipped=$(grep -oE '^\[  SKIPPED \] [0-9]+' "$log" | grep -oE '[0-9]+$' || true)
  failed=$(grep -E '^\[  FAILED  \] [A-Za-z]' "$log" | sed 's/^\[  FAILED  \] //' | sort -u | tr '\n' ' ')
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    echo "TIMEOUT after ${limit}s (last started: $(grep -E '^\[ RUN' "$log" | tail -1 | sed 's/.*RUN *\] *//'))"
  elif [ "$rc" = 0 ]; then
    echo "ok, ${passed:-0} passed, ${skipped:-0} skipped"
  else
    echo "FAILED rc $rc, ${passed:-0} passed: ${failed:-see the log (crash?)}"
  fi
}
