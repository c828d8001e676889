variable "cluster_name" {
  description = "Name of the cluster; used in node descriptions only (the state directory already scopes it)."
  type        = string

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9-]{0,39}$", var.cluster_name))
    error_message = "cluster_name must be 1-40 lower-case letters, digits or '-', starting with a letter or digit."
  }
}

variable "nodes" {
  description = "Number of nodes to provision. On this provider a node is a work directory plus the process tree started in it."
  type        = number

  validation {
    condition     = var.nodes >= 1 && floor(var.nodes) == var.nodes
    error_message = "nodes must be a whole number of at least 1."
  }
}

variable "processes_per_node" {
  description = "Training processes (ranks) each node runs; reported in the inventory."
  type        = number
  default     = 1

  validation {
    condition     = var.processes_per_node >= 1 && floor(var.processes_per_node) == var.processes_per_node
    error_message = "processes_per_node must be a whole number of at least 1."
  }
}

variable "state_dir" {
  description = "Absolute path of the cluster's state directory (.infractl/<cluster>); nodes live under <state_dir>/nodes/."
  type        = string

  validation {
    condition     = startswith(var.state_dir, "/")
    error_message = "state_dir must be an absolute path."
  }
}
