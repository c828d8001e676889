variable "cluster_name" {
  description = "Name of the cluster; written into the SSH keys' comments."
  type        = string

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9-]{0,39}$", var.cluster_name))
    error_message = "cluster_name must be 1-40 lower-case letters, digits or '-', starting with a letter or digit."
  }
}

variable "cluster_id" {
  description = "Six hex digits that name the cluster's kernel objects (bridge ixb<id>, veths ixv<id>-<i>, namespaces infractl-<id>-<i>): interface names are limited to 15 characters, so the cluster name cannot be used."
  type        = string

  validation {
    condition     = can(regex("^[0-9a-f]{6}$", var.cluster_id))
    error_message = "cluster_id must be six lower-case hex digits."
  }
}

variable "nodes" {
  description = "Number of nodes: one network namespace each, with its own address and sshd."
  type        = number

  validation {
    condition     = var.nodes >= 1 && var.nodes <= 253 && floor(var.nodes) == var.nodes
    error_message = "nodes must be a whole number from 1 to 253 (the addresses of a /24 after the network, the bridge and broadcast)."
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
  description = "Absolute path of the cluster's state directory (.infractl/<cluster>): nodes' work directories under nodes/, SSH keys under ssh/."
  type        = string

  validation {
    condition     = startswith(var.state_dir, "/")
    error_message = "state_dir must be an absolute path."
  }
}

variable "subnet" {
  description = "Private IPv4 /24 of the cluster's bridge: the host side is .1, node i is .(i+2)."
  type        = string

  validation {
    condition     = can(cidrhost(var.subnet, 0)) && endswith(var.subnet, "/24")
    error_message = "subnet must be an IPv4 /24 in CIDR form, e.g. 10.213.7.0/24."
  }
}

variable "sshd" {
  description = "Absolute path of the sshd binary started in each namespace."
  type        = string
  default     = "/usr/sbin/sshd"
}
