export INFRACTL_HOME="$home"
$require_env
state_of_run() {
  infractl status -c $cluster --json | python3 -c '
import json, sys
print(next((r["state"] for r in json.load(sys.stdin)["runs"] if r["run"] == sys.argv[1]), "unknown"))' $run
}
state=$$(state_of_run)
echo "run $run is $$state"
case "$$state" in
  running|restarting)
    # The survivors go on, or wait in the rendezvous below nodes.min ($nodes_min): bring back
    # each node that has no process left, up to nodes.max ($nodes_max).
    left=$$(infractl status -c $cluster --json | python3 -c '
import json, sys
nodes = json.load(sys.stdin)["nodes"]
idle = [n["name"] for n in nodes if n["live_processes"] == 0]
print(" ".join(idle[: max(0, int(sys.argv[1]) - (len(nodes) - len(idle)))]))' $nodes_max)
    for node in $$left; do
      # A run that was finishing may have completed since: then there is nothing to rejoin.
      infractl rejoin "$$node" --run $run -c $cluster || [ "$$(state_of_run)" = completed ]
    done
    [ -n "$$left" ] || echo "no node of run $run is missing"
    ;;
  completed)
    echo "run $run has completed: nothing to recover"
    ;;
  *)
    # Stopped or failed: launch it again; it resumes from its last committed checkpoint.
    infractl train $config -c $cluster --detach
    ;;
esac
