output "inventory" {
  description = "The provisioned nodes, in index order: name, address, absolute work directory and processes per node."
  value = [
    for node in terraform_data.node : {
      name      = node.output.name
      address   = "127.0.0.1"
      workdir   = node.output.workdir
      processes = var.processes_per_node
    }
  ]
}
