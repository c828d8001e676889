output "inventory" {
  description = "The provisioned nodes, in index order: name, address (in the namespace), work directory, processes per node, and how to reach its sshd."
  value = [
    for node in terraform_data.node : {
      name      = node.output.name
      address   = node.output.address
      workdir   = node.output.workdir
      processes = var.processes_per_node
      ssh = {
        user          = "root"
        identity_file = node.output.identity_file
        known_hosts   = node.output.known_hosts
      }
    }
  ]
}
