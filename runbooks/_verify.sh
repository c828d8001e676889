export INFRACTL_HOME="$home"
# Up to 15 minutes: a step trained on all $world ranks after this moment, or the run completed
# (its last step committed).
since=$$(date +%s)
verdict=""
for _ in $$(seq 180); do
  state=$$(infractl status -c $cluster --json | python3 -c '
import json, sys
print(next((r["state"] for r in json.load(sys.stdin)["runs"] if r["run"] == sys.argv[1]), "unknown"))' $run)
  verdict=$$(infractl metrics $run -c $cluster --json | python3 -c '
import json, sys
since, world, state = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
records = json.load(sys.stdin)
fresh = [r for r in records if r["time"] > since and r["world_size"] == world]
if records and (fresh or state == "completed"):
    r = (fresh or records)[-1]
    print("%s, step %d on %d ranks, loss %.4f" % (state, r["step"], r["world_size"], r["loss"]))' "$$since" $world "$$state")
  [ -z "$$verdict" ] || break
  sleep 5
done
if [ -z "$$verdict" ]; then
  echo "run $run has not recovered in 15 minutes: follow full-restart.md" >&2
  exit 1
fi
echo "run $run recovered: $$verdict"
infractl status -c $cluster
# Where each rank started from: `resumed step=N` (the last committed step), after `rank_joined`.
infractl logs -c $cluster --run $run --tail 400 | grep -E "rank_joined|resumed|starting" | tail -n $world || true
