locals {
  state_dir = trimsuffix(var.state_dir, "/")
  ssh_dir   = "${local.state_dir}/ssh"
  bridge    = "ixb${var.cluster_id}"
  gateway   = cidrhost(var.subnet, 1)
}

# The cluster's client key: Ansible and the launcher log in to every node's sshd with it. The
# private key never leaves the state directory (0600 in a 0700 directory).
resource "terraform_data" "keys" {
  triggers_replace = local.ssh_dir
  input = {
    ssh_dir = local.ssh_dir
    comment = "infractl-${var.cluster_name}"
  }

  provisioner "local-exec" {
    command = "umask 077 && mkdir -p \"$SSH_DIR/nodes\" && { [ -f \"$SSH_DIR/id_ed25519\" ] || ssh-keygen -q -t ed25519 -N '' -C \"$COMMENT\" -f \"$SSH_DIR/id_ed25519\"; }"
    environment = {
      SSH_DIR = self.input.ssh_dir
      COMMENT = self.input.comment
    }
  }

  provisioner "local-exec" {
    when    = destroy
    command = "rm -rf -- \"$SSH_DIR\""
    environment = {
      SSH_DIR = self.input.ssh_dir
    }
  }
}

# The switch every node's link plugs into; its address on the host side is where the cluster's
# rendezvous endpoint listens, outside every node.
resource "terraform_data" "bridge" {
  triggers_replace = "${local.bridge} ${var.subnet}"
  input = {
    bridge  = local.bridge
    gateway = local.gateway
  }

  provisioner "local-exec" {
    command = "ip link add \"$BRIDGE\" type bridge && ip addr add \"$GATEWAY/24\" dev \"$BRIDGE\" && ip link set \"$BRIDGE\" up"
    environment = {
      BRIDGE  = self.input.bridge
      GATEWAY = self.input.gateway
    }
  }

  provisioner "local-exec" {
    when    = destroy
    command = "! ip link show \"$BRIDGE\" >/dev/null 2>&1 || ip link del \"$BRIDGE\""
    environment = {
      BRIDGE = self.input.bridge
    }
  }
}

# The bridge's host side is the cluster's control plane (the rendezvous endpoint, the image
# registry): it takes connections from the nodes' addresses only. Anything else plugged into the
# bridge is refused before it reaches a server (torch's rendezvous store trusts whoever reaches it).
resource "terraform_data" "guard" {
  depends_on       = [terraform_data.bridge]
  triggers_replace = "${local.bridge} ${var.subnet} ${var.nodes}"
  input = {
    bridge = local.bridge
    chain  = "ixg${var.cluster_id}"
  }

  provisioner "local-exec" {
    command = <<-EOT
      iptables -w -N "$CHAIN" 2>/dev/null || iptables -w -F "$CHAIN"
      iptables -w -A "$CHAIN" -m iprange --src-range "$FIRST-$LAST" -j RETURN
      iptables -w -A "$CHAIN" -j REJECT --reject-with icmp-port-unreachable
      iptables -w -C INPUT -i "$BRIDGE" -j "$CHAIN" 2>/dev/null || iptables -w -I INPUT 1 -i "$BRIDGE" -j "$CHAIN"
    EOT
    environment = {
      BRIDGE = self.input.bridge
      CHAIN  = self.input.chain
      FIRST  = cidrhost(var.subnet, 2)
      LAST   = cidrhost(var.subnet, var.nodes + 1)
    }
  }

  provisioner "local-exec" {
    when    = destroy
    command = <<-EOT
      while iptables -w -D INPUT -i "$BRIDGE" -j "$CHAIN" 2>/dev/null; do :; done
      ! iptables -w -S "$CHAIN" >/dev/null 2>&1 || { iptables -w -F "$CHAIN" && iptables -w -X "$CHAIN"; }
    EOT
    environment = {
      BRIDGE = self.input.bridge
      CHAIN  = self.input.chain
    }
  }
}

# One namespace per node: a veth into the bridge (eth0 inside), its own address, its own sshd,
# and a work directory on the shared filesystem.
resource "terraform_data" "node" {
  count      = var.nodes
  depends_on = [terraform_data.keys, terraform_data.bridge]

  triggers_replace = "infractl-${var.cluster_id}-${count.index} ${var.subnet}"

  # Destroy-time provisioners may only reference self: everything they need travels in input.
  input = {
    name          = "node-${count.index}"
    namespace     = "infractl-${var.cluster_id}-${count.index}"
    veth          = "ixv${var.cluster_id}-${count.index}"
    address       = cidrhost(var.subnet, count.index + 2)
    workdir       = "${local.state_dir}/nodes/node-${count.index}"
    node_ssh_dir  = "${local.ssh_dir}/nodes/node-${count.index}"
    identity_file = "${local.ssh_dir}/id_ed25519"
    known_hosts   = "${local.ssh_dir}/nodes/node-${count.index}/known_hosts"
    script        = "${path.module}/node.sh"
  }

  provisioner "local-exec" {
    command = "\"$SCRIPT\" create"
    environment = {
      SCRIPT       = self.input.script
      NAME         = self.input.name
      NAMESPACE    = self.input.namespace
      VETH         = self.input.veth
      BRIDGE       = local.bridge
      ADDRESS      = self.input.address
      WORKDIR      = self.input.workdir
      NODE_SSH_DIR = self.input.node_ssh_dir
      AUTHORIZED   = "${self.input.identity_file}.pub"
      KNOWN_HOSTS  = self.input.known_hosts
      SSHD         = var.sshd
    }
  }

  provisioner "local-exec" {
    when    = destroy
    command = "\"$SCRIPT\" destroy"
    environment = {
      SCRIPT       = self.input.script
      NAMESPACE    = self.input.namespace
      VETH         = self.input.veth
      WORKDIR      = self.input.workdir
      NODE_SSH_DIR = self.input.node_ssh_dir
    }
  }
}
