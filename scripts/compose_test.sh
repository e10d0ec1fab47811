# The scenarios of `scripts/compose.sh test` and `scripts/compose.sh bench`; sourced by compose.sh after it
# has built the image (its helpers: say, compose, certs, FILES, PROJECT, LOG, PY).
# Every wait polls with a deadline: nothing here waits on a sleep or without a bound.
STEPS=${PARAMPLANE_STEPS:-2000}  # ~7-15 ms a step here: the kills land well inside the run
SAVE_EVERY=${PARAMPLANE_SAVE_EVERY:-250}
HEARTBEAT_S=15  # the coordinator's --heartbeat-timeout in docker-compose.yml
OUT=.compose/out
TOKEN=/run/secrets/paramplane_token

fail() {
  say "FAILED: $*"
  compose logs --no-color >"$OUT/failed.log" 2>&1 || true
  say "every container's log: $OUT/failed.log"
  exit 1
}
cid() { compose ps -q "$1"; }

# poll DESCRIPTION SECONDS COMMAND...: run COMMAND until it succeeds; after SECONDS say so and return 1.
poll() {
  local what=$1 limit=$2 end=$((SECONDS + $2))
  shift 2
  until "$@"; do
    [ "$SECONDS" -lt "$end" ] || { say "timed out: $what (waited $limit s)"; return 1; }
    sleep 0.2  # the poll's period; what it waits for is the command's answer
  done
}

status_json() {  # the coordinator's status (paramplane status --json), asked inside its container
  docker exec "$(cid coordinator)" paramplane status --json --timeout 3 --token-file "$TOKEN" 127.0.0.1:29400 2>/dev/null
}
status_has() {  # status_has PYTHON-EXPRESSION-OVER-s [SAVE-AS]: the status satisfies the expression
  local s
  s=$(status_json) || return 1
  $PY -c 'import json, sys; s = json.loads(sys.argv[1]); sys.exit(0 if eval(sys.argv[2]) else 1)' "$s" "$1" || return 1
  [ -z "${2:-}" ] || printf '%s\n' "$s" >"$OUT/$2"
}
committed() { test -f "$CKPT/step_$1/manifest.json"; }
committed_any() { compgen -G "$CKPT/step_*/manifest.json" >/dev/null; }  # keep=2 prunes the oldest
exited_ok() { [ "$(docker inspect -f '{{.State.Status}} {{.State.ExitCode}}' "$(cid "$1")")" = "exited 0" ]; }
both_exited_ok() { exited_ok node-a && exited_ok node-b; }
healthy() { [ "$(docker inspect -f '{{.State.Health.Status}}' "$(cid coordinator)")" = healthy ]; }
logged() { grep -q "$1" <<<"$(compose logs --no-color node-a node-b 2>/dev/null)"; }

# start RUN [VAR=VALUE...]: a fresh job named RUN (checkpoints in /ckpt/RUN, traces in /trace/RUN) on a
# restarted coordinator. The volumes and the coordinator's container stay between runs (creating a container
# copies the whole image under the vfs storage driver).
start() {
  local run=$1
  shift
  compose rm -sf node-a node-b >>"$LOG" 2>&1 || true
  export PARAMPLANE_RUN=$run PARAMPLANE_STEPS=$STEPS PARAMPLANE_SAVE_EVERY=$SAVE_EVERY PARAMPLANE_LOG_EVERY=1
  export PARAMPLANE_TCP_LANE=1 PARAMPLANE_HIDDEN=64
  [ $# -eq 0 ] || export "$@"
  compose up -d coordinator >>"$LOG" 2>&1 || { tail -30 "$LOG" >&2; fail "$run: the coordinator did not start"; }
  compose restart -t 5 coordinator >>"$LOG" 2>&1 || fail "$run: the coordinator did not restart"
  poll "$run: the coordinator is healthy" 120 healthy || fail "$run: no healthy coordinator"
  if [ -z "$(docker ps -q --filter "name=^${PROJECT}_checker$")" ]; then  # one container runs every check
    docker rm -f "${PROJECT}_checker" >/dev/null 2>&1 || true  # (made before the job: creating one is slow)
    docker run -d --name "${PROJECT}_checker" --entrypoint sleep -v "$PWD/$OUT:/out" -v "$PWD/scripts:/scripts:ro" \
      -v "${PROJECT}_ckpt:/ckpt" -v "${PROJECT}_trace:/trace" paramplane:local 86400 >>"$LOG" \
      || fail "the checker container did not start"
  fi
  compose up -d --no-recreate node-a node-b >>"$LOG" 2>&1 || { tail -30 "$LOG" >&2; fail "$run: the nodes did not start"; }
  CKPT=$(docker volume inspect -f '{{.Mountpoint}}' "$(docker inspect -f '{{range .Mounts}}{{if eq .Destination "/ckpt"}}{{.Name}}{{end}}{{end}}' "$(cid node-a)")")/$run
}

# finish RUN LIMIT CHECK-ARGS...: both nodes end with status 0, then scripts/compose_check.py's assertions.
finish() {
  local run=$1 limit=$2
  shift 2
  poll "$run: both nodes finished with status 0" "$limit" both_exited_ok
  compose logs --no-color node-a node-b >"$OUT/$run.log" 2>&1
  both_exited_ok || { tail -40 "$OUT/$run.log" >&2; fail "$run: the nodes did not finish"; }
  local rc=0
  docker exec "${PROJECT}_checker" python /scripts/compose_check.py "$run" --steps "$STEPS" --save-every "$SAVE_EVERY" "$@" >"$OUT/$run.check" 2>&1 \
    || rc=$?
  tee -a "$OUT/checks.txt" <"$OUT/$run.check" >&2
  [ "$rc" = 0 ] || fail "$run: the checks above"
}

scenario_unbroken() {
  start unbroken
  finish unbroken 240 --frames lane
  grep -q "hosts 2, ranks 4, shard group 2" "$OUT/unbroken.log" || fail "the world was not 2 hosts x 2 ranks"
  acc=$(grep -o 'accuracy: [0-9.]*' "$OUT/unbroken.log" | tail -1 | cut -d' ' -f2)
  $PY -c "import sys; sys.exit(0 if float('${acc:-0}') > 0.9 else 1)" || fail "accuracy ${acc:-none}"
  say "PASSED unbroken: 2 hosts x 2 ranks, $STEPS steps, accuracy $acc, inter-host frames on TCP lanes"
}

scenario_kill_node() {
  start kill-node
  poll "kill-node: a checkpoint committed" 240 committed_any || fail "kill-node: no checkpoint"
  docker kill "$(cid node-b)" >/dev/null || fail "kill-node: node-b was not running (the job ended first?)"
  local killed=$SECONDS
  committed "$STEPS" && fail "kill-node: the job finished before the kill (raise PARAMPLANE_STEPS)"
  say "kill-node: docker kill node-b; committed: $(cd "$CKPT" && echo step_*/manifest.json)"
  # The world of the kill (asked right after it: the coordinator ends it only once it notices).
  status_has 's["epoch"] >= 1' kill-node.status-before.json || fail "kill-node: no status from the coordinator"
  local before
  # (a status still forming the next epoch means the killed one is the epoch before)
  before=$($PY -c 'import json,sys; s=json.load(open(sys.argv[1])); print(s["epoch"] - (not s["formed"]))' "$OUT/kill-node.status-before.json")
  # The world is aborted (or already replaced: the survivors' restarted ranks open the next epoch).
  poll "kill-node: the coordinator ends epoch $before" $((HEARTBEAT_S + 30)) \
    status_has "s['aborted'] or s['epoch'] > $before" kill-node.status-aborted.json || fail "kill-node: epoch $before lives on"
  say "kill-node: epoch $before ended $((SECONDS - killed)) s after the kill: $(tr -d '\n' <"$OUT/kill-node.status-aborted.json" | grep -o '"abort_reason": "[^"]*"')"
  # docker keeps a container stopped by `docker kill` down (a manual stop); a crash would be restarted by
  # the restart policy. The operator (here, this script) brings it back:
  compose start node-b >>"$LOG" 2>&1 || fail "kill-node: compose start node-b"
  poll "kill-node: the next epoch forms with both hosts" 120 \
    status_has "s['formed'] and not s['aborted'] and s['epoch'] > $before and {r['host_id'] for r in s['ranks']} == {'node-a', 'node-b'}" \
    kill-node.status-after.json || fail "kill-node: no new world"
  finish kill-node 240 --frames lane --resumed launcher --same-as unbroken
  say "PASSED kill-node: epoch $before aborted, the next formed; resumed from the newest checkpoint, same parameters"
}

scenario_kill_coordinator() {
  # The data plane needs no coordinator: the job must outlast the heartbeat timeout after the kill.
  local STEPS=$((STEPS * 3))
  start kill-coordinator
  poll "kill-coordinator: a checkpoint committed" 240 committed_any || fail "kill-coordinator: no checkpoint"
  docker kill "$(cid coordinator)" >/dev/null || fail "kill-coordinator: the coordinator was not running"
  committed "$STEPS" && fail "kill-coordinator: the job finished before the kill (raise PARAMPLANE_STEPS)"
  local killed=$SECONDS
  poll "kill-coordinator: the ranks name the lost coordinator" $((HEARTBEAT_S + 30)) \
    logged "the coordinator at coordinator:29400 has not answered" || fail "kill-coordinator: the ranks went on"
  local noticed=$((SECONDS - killed))
  [ "$noticed" -le $((HEARTBEAT_S + 15)) ] || fail "kill-coordinator: the ranks took $noticed s (heartbeat timeout $HEARTBEAT_S s)"
  say "kill-coordinator: the ranks stopped naming the lost coordinator after ${noticed} s"
  # The launchers exit ("did not answer ... not restarting"); restart the coordinator, then the nodes.
  compose stop -t 5 node-a node-b >>"$LOG" 2>&1 || true
  compose start coordinator >>"$LOG" 2>&1 || fail "kill-coordinator: compose start coordinator"
  poll "kill-coordinator: the restarted coordinator is healthy" 60 healthy || fail "kill-coordinator: no coordinator"
  compose start node-a node-b >>"$LOG" 2>&1 || fail "kill-coordinator: compose start node-a node-b"
  finish kill-coordinator 300 --frames lane --resumed operator
  say "PASSED kill-coordinator: a restarted coordinator and nodes resumed from the newest checkpoint"
}

scenario_tls() {
  FILES=(-f docker-compose.yml -f docker-compose.tls.yml)
  certs
  start tls
  finish tls 240 --frames grpc-stream --same-as unbroken
  FILES=(-f docker-compose.yml)
  say "PASSED tls: inter-host frames rode gRPC streams under TLS, intra-host shm; same parameters as lanes"
}

compose_test() {
  # PARAMPLANE_COMPOSE_SCENARIOS picks some (the others compare with unbroken's result from a former run).
  local began=$SECONDS scenarios=${PARAMPLANE_COMPOSE_SCENARIOS:-unbroken kill_node kill_coordinator tls}
  [ -n "${PARAMPLANE_COMPOSE_SCENARIOS:-}" ] || rm -rf "$OUT"
  mkdir -p "$OUT"
  compose down -v --remove-orphans >>"$LOG" 2>&1 || true  # a former run's volumes
  for scenario in $scenarios; do
    case $scenario in
      unbroken | kill_node | kill_coordinator | tls) "scenario_$scenario" ;;
      *) fail "no scenario $scenario" ;;
    esac
  done
  say "PASSED: every scenario in $((SECONDS - began)) s (checks: $OUT/checks.txt)"
}

# bench: the median HybridShard step time of one job per transport, JSON lines in benchmarks/results.
compose_bench() {
  mkdir -p "$OUT" benchmarks/results
  local results=benchmarks/results/compose.jsonl hidden transport
  for hidden in ${PARAMPLANE_BENCH_HIDDEN:-64 1024}; do
    for transport in lane grpc-stream grpc-stream+tls; do
      FILES=(-f docker-compose.yml)
      local lane=1
      [ "$transport" = lane ] || lane=0
      if [ "$transport" = grpc-stream+tls ]; then
        certs
        FILES+=(-f docker-compose.tls.yml)
      fi
      STEPS=${PARAMPLANE_BENCH_STEPS:-200} SAVE_EVERY=100000
      start "bench-$hidden-$transport" PARAMPLANE_TCP_LANE=$lane PARAMPLANE_HIDDEN="$hidden" PARAMPLANE_LOG_EVERY=0
      poll "bench: both nodes finished" 600 both_exited_ok || fail "bench: $transport"
      compose logs --no-color node-a node-b >"$OUT/bench.log" 2>&1
      local ms
      ms=$(grep -o 'step time: [0-9.]*' "$OUT/bench.log" | tail -1 | cut -d' ' -f3)
      [ -n "$ms" ] || { tail -30 "$OUT/bench.log" >&2; fail "bench: no step time for $transport"; }
      grep -q "frames ${transport%+tls} " "$OUT/bench.log" || fail "bench: $transport did not carry the frames"
      printf '{"bench": "compose_hybrid_shard", "transport": "%s", "hidden": %s, "params": %s, "ranks": 4, "hosts": 2, "steps": %s, "step_ms_median": %s, "date": "%s"}\n' \
        "$transport" "$hidden" $((32 * hidden + hidden + hidden * hidden + hidden + 4 * hidden + 4)) "$STEPS" "$ms" "$(date -u +%FT%TZ)" \
        | tee -a "$results"
    done
  done
  FILES=(-f docker-compose.yml)
  compose down -v --remove-orphans >>"$LOG" 2>&1 || true
}
