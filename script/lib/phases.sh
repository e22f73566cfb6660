# Phases of a long script, timed: `phase NAME COMMAND...` runs COMMAND and records its wall
# time and outcome; the table of every phase, the total and the slowest examples of every
# rspec run (script/lib/slowest.rb, from the JSON rspec wrote in $PHASES_DIR) are printed when
# the script exits, pass or fail, so a slow or failed run says where its time went; the last
# line says what was not run, and why (script/lib/not_run.rb).
# Sourced by script/test.

PHASES_DIR=${PHASES_DIR:-tmp/ci}
phase_rows=()
phases_started=$SECONDS

# A phase that ran elsewhere (in the background): NAME, seconds, outcome.
phase_record() {
  phase_rows+=("$(printf '%-44s %6ss  %s' "$1" "$2" "$3")")
}

phase() {
  local name=$1 start=$SECONDS rc=0
  shift
  echo "=== $name" >&2
  "$@" || rc=$?
  phase_record "$name" $((SECONDS - start)) "$([[ $rc == 0 ]] && echo ok || echo "FAILED ($rc)")"
  return "$rc"
}

# A phase that runs in the background while the script goes on: `phase_start NAME COMMAND...`
# (its output goes to $PHASES_DIR/NAME.log), then `phase_join NAME`, which waits for it,
# prints its output, records its time and returns its status.
declare -A phase_bg_pid=() phase_bg_log=()
phase_start() {
  local name=$1 log
  shift
  log=$PHASES_DIR/bg-${#phase_bg_pid[@]}.log
  (
    start=$SECONDS rc=0
    "$@" >"$log" 2>&1 || rc=$?
    echo "$rc $((SECONDS - start))" >"$log.done"
  ) &
  phase_bg_pid[$name]=$!
  phase_bg_log[$name]=$log
}

phase_join() {
  local name=$1 waited=$SECONDS rc took log=${phase_bg_log[$1]}
  wait "${phase_bg_pid[$name]}" || true
  read -r rc took <"$log.done"
  echo "=== $name (ran in the background)" >&2
  cat "$log" >&2
  phase_record "$name" "$took" \
    "$([[ $rc == 0 ]] && echo ok || echo "FAILED ($rc)"), in the background; waited $((SECONDS - waited)) s"
  return "$rc"
}

kill_tree() {
  local child
  for child in $(pgrep -P "$1"); do kill_tree "$child"; done
  kill "$1" 2>/dev/null || true
}

phases_report() {
  local rc=$? name
  # A background phase still running when the script ends (it failed early) is stopped,
  # with every process it started.
  for name in "${!phase_bg_pid[@]}"; do
    [[ -f ${phase_bg_log[$name]}.done ]] || kill_tree "${phase_bg_pid[$name]}"
  done
  ((${#phase_rows[@]})) || return "$rc"
  {
    echo
    echo "--- phases (wall time)"
    printf '%s\n' "${phase_rows[@]}"
    printf '%-44s %6ss  %s\n' "total" $((SECONDS - phases_started)) "$([[ $rc == 0 ]] && echo passed || echo "failed ($rc)")"
    if compgen -G "$PHASES_DIR/rspec/*.json" >/dev/null; then
      echo
      echo "--- the 10 slowest examples of every rspec run"
      ruby script/lib/slowest.rb 10 "$PHASES_DIR"/rspec/*.json || true
    fi
    # The last line: what was not run here, and why (script/lib/not_run.rb).
    echo
    script/rubies list >"$PHASES_DIR/rubies.list" 2>/dev/null || true
    ruby script/lib/not_run.rb "$PHASES_DIR/rubies.list" "$PHASES_DIR"/rspec/*.json 2>/dev/null ||
      echo "not run here: unknown (script/lib/not_run.rb failed)"
  } >&2
  return "$rc"
}
trap phases_report EXIT
