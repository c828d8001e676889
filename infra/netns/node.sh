#!/bin/sh
# One node of infra/netns, created or destroyed by main.tf's provisioners (settings in the
# environment): a network namespace plugged into the cluster's bridge, with its own address and
# an sshd that accepts only the cluster's key.
set -eu

create() {
  umask 077
  mkdir -p "$WORKDIR" "$NODE_SSH_DIR"
  chmod 0700 "$WORKDIR" "$NODE_SSH_DIR"
  ip netns add "$NAMESPACE"
  ip link add "$VETH" type veth peer name eth0 netns "$NAMESPACE"
  ip link set "$VETH" master "$BRIDGE" up
  ip -n "$NAMESPACE" addr add "$ADDRESS/24" dev eth0
  ip -n "$NAMESPACE" link set eth0 up
  ip -n "$NAMESPACE" link set lo up
  key="$NODE_SSH_DIR/ssh_host_ed25519_key"
  [ -f "$key" ] || ssh-keygen -q -t ed25519 -N '' -C "$NAME" -f "$key"
  # StrictModes would refuse the authorized key under a world-writable /tmp even though the state
  # directory itself is 0700 and root's: the check walks every parent up to /.
  cat >"$NODE_SSH_DIR/sshd_config" <<CONF
ListenAddress $ADDRESS
HostKey $key
PidFile $NODE_SSH_DIR/sshd.pid
AuthorizedKeysFile $AUTHORIZED
AllowUsers root
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
X11Forwarding no
AllowTcpForwarding no
Subsystem sftp internal-sftp
CONF
  # sshd's privilege-separation directory (the openssh-server package's service makes it at boot).
  mkdir -p /run/sshd
  # sshd binds its port before it daemonizes: once this returns, the node accepts logins. It enters
  # the namespace's network only: `ip netns exec` would also remount /sys, hiding the cgroup mounts
  # that every command arriving over SSH (a container engine among them) needs.
  nsenter --net="/run/netns/$NAMESPACE" "$SSHD" -f "$NODE_SSH_DIR/sshd_config" -E "$NODE_SSH_DIR/sshd.log"
  # Pin the host key: clients check it (StrictHostKeyChecking=yes) against this file only.
  printf '%s %s\n' "$ADDRESS" "$(cut -d' ' -f1,2 "$key.pub")" >"$KNOWN_HOSTS"
}

destroy() {
  # Every process in the namespace (sshd, anything a run left), then the namespace: deleting it
  # deletes its end of the veth pair, and the kernel removes the other end with it.
  pids="$(ip netns pids "$NAMESPACE" 2>/dev/null || true)"
  [ -z "$pids" ] || kill -9 $pids 2>/dev/null || true
  ! ip netns list | grep -qw "^$NAMESPACE" || ip netns del "$NAMESPACE"
  # The kernel removes the veth pair once the namespace is gone, a moment later: wait for it,
  # then delete what is left (and only fail if it is still there).
  tries=0
  while ip link show "$VETH" >/dev/null 2>&1 && [ "$tries" -lt 50 ]; do
    sleep 0.1
    tries=$((tries + 1))
  done
  ip link del "$VETH" 2>/dev/null || ! ip link show "$VETH" >/dev/null 2>&1
  rm -rf -- "$WORKDIR" "$NODE_SSH_DIR"
}

case "${1:-}" in
  create) create ;;
  destroy) destroy ;;
  *) echo "usage: $0 create|destroy (settings in the environment, see main.tf)" >&2; exit 2 ;;
esac
