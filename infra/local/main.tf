locals {
  nodes_dir = "${trimsuffix(var.state_dir, "/")}/nodes"
}

# One instance per node. The work directory is the node: creating it provisions the node,
# removing it (with everything the node wrote) destroys it.
resource "terraform_data" "node" {
  count = var.nodes

  # A node whose path changes is a different node: replace it rather than update it in place.
  triggers_replace = "${local.nodes_dir}/node-${count.index}"

  # Destroy-time provisioners may only reference self, so the path travels in input.
  input = {
    name    = "node-${count.index}"
    cluster = var.cluster_name
    workdir = "${local.nodes_dir}/node-${count.index}"
  }

  provisioner "local-exec" {
    command = "umask 077 && mkdir -p \"$WORKDIR\" && chmod 0700 \"$WORKDIR\""
    environment = {
      WORKDIR = self.input.workdir
    }
  }

  provisioner "local-exec" {
    when    = destroy
    command = "rm -rf -- \"$WORKDIR\""
    environment = {
      WORKDIR = self.input.workdir
    }
  }
}
