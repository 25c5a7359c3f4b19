# shellcheck shell=bash disable=SC2154,SC2034  # out, budget come from the sourcing script; status is read there
# Sourced by the device-call scripts that run stages within one budget (change_check.sh,
# issue20_timings.sh): `left` prints the seconds the call has left; `stage name command...` runs the
# command with that as its timeout, logging to $out/name.log, or reports NOT RUN when under 30 s
# are left. A stage that fails or does not run sets status=1 and returns 1.
# Needs before sourcing: out (the log folder) and budget (the call's seconds).
start=$(date +%s)
status=0
left() { echo $(( budget - ($(date +%s) - start) )); }
stage() {
  local name=$1; shift
  local rest; rest=$(left)
  if [ "$rest" -lt 30 ]; then echo "NOT RUN $name (${rest} s left)"; status=1; return 1; fi
  echo "######## $name (${rest} s left)"
  timeout "$rest" "$@" > "$out/$name.log" 2>&1 || { echo "FAILED $name (exit $?)"; status=1; return 1; }
}
