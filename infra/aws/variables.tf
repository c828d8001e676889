variable "cluster_name" {
  description = "Name of the cluster: prefixes resource names and is the value of the infractl:cluster tag on every resource."
  type        = string
  nullable    = false

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9-]{0,39}$", var.cluster_name))
    error_message = "cluster_name must be 1-40 lower-case letters, digits or '-', starting with a letter or digit."
  }
}

variable "node_groups" {
  description = "Training nodes by group name: instance type (a key of instances.json), node count and market (spot or on-demand). A node is named <group>-<index>."
  type = map(object({
    instance_type = string
    nodes         = number
    spot          = optional(bool, false)
  }))
  nullable = false

  validation {
    condition     = length(var.node_groups) >= 1 && alltrue([for name in keys(var.node_groups) : can(regex("^[a-z][a-z0-9]{0,15}$", name))])
    error_message = "node_groups needs at least one group; a group name is 1-16 lower-case letters or digits, starting with a letter."
  }

  validation {
    condition     = alltrue([for group in values(var.node_groups) : contains(keys(local.instance_types), group.instance_type)])
    error_message = "node_groups[*].instance_type must be one of: c7i.16xlarge, c7i.4xlarge, c7i.8xlarge, g5.12xlarge, g5.48xlarge, g6.12xlarge, g6.48xlarge, m7i.16xlarge, m7i.4xlarge, m7i.8xlarge, p4d.24xlarge, p5.48xlarge, p5en.48xlarge (the types in instances.json)."
  }

  validation {
    condition     = alltrue([for group in values(var.node_groups) : group.nodes >= 1 && group.nodes <= 64 && floor(group.nodes) == group.nodes])
    error_message = "node_groups[*].nodes must be a whole number from 1 to 64."
  }
}

variable "processes_per_node" {
  description = "Training processes (ranks) per node, reported in the inventory. Null: one per GPU of the node's instance type."
  type        = number
  default     = null

  validation {
    # A conditional, not ||: Terraform before 1.12 evaluates both sides of ||, and floor(null) fails.
    condition     = var.processes_per_node == null ? true : (var.processes_per_node >= 1 && var.processes_per_node <= 64 && floor(var.processes_per_node) == var.processes_per_node)
    error_message = "processes_per_node must be null or a whole number from 1 to 64."
  }
}

variable "availability_zone" {
  description = "Availability zone of the subnet the module creates (all nodes share one zone: a cluster placement group cannot span zones). Required when subnet_id is null; ignored otherwise."
  type        = string
  default     = null

  validation {
    condition     = var.subnet_id != null || var.availability_zone != null
    error_message = "availability_zone is required when the module creates the network (subnet_id is null)."
  }

  validation {
    condition     = var.availability_zone == null || can(regex("^[a-z]{2}(-[a-z]+)+-[0-9][a-z]$", var.availability_zone))
    error_message = "availability_zone must be a zone name such as us-east-1a."
  }
}

variable "vpc_id" {
  description = "Existing VPC to run in, together with subnet_id. Null: the module creates a VPC, subnets, a NAT gateway and an S3 gateway endpoint."
  type        = string
  default     = null

  validation {
    condition     = var.vpc_id == null || can(regex("^vpc-[0-9a-f]{8,17}$", var.vpc_id))
    error_message = "vpc_id must be null or a VPC id (vpc-0123456789abcdef0)."
  }
}

variable "subnet_id" {
  description = "Existing private subnet of vpc_id for every instance. It must already route to the internet (a NAT gateway) or have the VPC endpoint the nodes need (S3). Null: the module creates the network."
  type        = string
  default     = null

  validation {
    condition     = var.subnet_id == null || can(regex("^subnet-[0-9a-f]{8,17}$", var.subnet_id))
    error_message = "subnet_id must be null or a subnet id (subnet-0123456789abcdef0)."
  }

  validation {
    condition     = (var.subnet_id == null) == (var.vpc_id == null)
    error_message = "vpc_id and subnet_id go together: set both to use an existing network, or neither to create one."
  }
}

variable "vpc_cidr" {
  description = "Address range of the VPC the module creates; the node subnet is its first sixteenth, the NAT subnet the second."
  type        = string
  default     = "10.42.0.0/16"
  nullable    = false

  validation {
    condition     = can(cidrsubnet(var.vpc_cidr, 4, 1)) && try(tonumber(split("/", var.vpc_cidr)[1]) >= 16 && tonumber(split("/", var.vpc_cidr)[1]) <= 24, false)
    error_message = "vpc_cidr must be an IPv4 CIDR block from /16 to /24, such as 10.42.0.0/16."
  }
}

variable "store_bucket" {
  description = "S3 bucket of the cluster's store (checkpoints, metrics, run records). Nodes may read, write and delete objects under store_prefix only."
  type        = string
  nullable    = false

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", var.store_bucket))
    error_message = "store_bucket must be an S3 bucket name: 3-63 lower-case letters, digits, '.' or '-', starting and ending with a letter or digit."
  }
}

variable "store_prefix" {
  description = "Key prefix of the store in store_bucket, without leading or trailing '/'. The nodes' rights are scoped to it: never the whole bucket."
  type        = string
  nullable    = false

  validation {
    condition     = can(regex("^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$", var.store_prefix))
    error_message = "store_prefix must be '/'-separated segments of letters, digits, '.', '_' or '-', with no leading or trailing '/' (not empty: the nodes would get the whole bucket)."
  }
}

variable "create_bucket" {
  description = "Create store_bucket (versioned, encrypted, public access blocked, TLS only, lifecycle rules) with the cluster. False: the bucket exists already and is left as it is (infractl up refuses one whose public access is not blocked, that is not versioned, or whose policy admits requests without TLS)."
  type        = bool
  default     = false
  nullable    = false
}

variable "bucket_force_destroy" {
  description = "Only with create_bucket: let teardown delete the bucket together with every object in it, checkpoints included. False: teardown fails on a non-empty bucket and the data stays."
  type        = bool
  default     = false
  nullable    = false
}

variable "require_tls" {
  description = "With create_bucket: a bucket policy refuses requests without TLS or below TLS 1.2. Off only for an S3 endpoint that has no TLS (a private or emulated one)."
  type        = bool
  default     = true
  nullable    = false
}

variable "noncurrent_version_days" {
  description = "Only with create_bucket: days a replaced or deleted object's old version is kept before S3 expires it (checkpoint retention deletes steps; their versions would otherwise be billed forever)."
  type        = number
  default     = 7
  nullable    = false

  validation {
    condition     = var.noncurrent_version_days >= 1 && var.noncurrent_version_days <= 365 && floor(var.noncurrent_version_days) == var.noncurrent_version_days
    error_message = "noncurrent_version_days must be a whole number from 1 to 365."
  }
}

variable "store_kms_key_arn" {
  description = "KMS key that encrypts an existing store_bucket (SSE-KMS with a customer-managed key): nodes get kms:Decrypt and kms:GenerateDataKey on it. Null: the bucket uses S3-managed or AWS-managed keys."
  type        = string
  default     = null

  validation {
    condition     = var.store_kms_key_arn == null || can(regex("^arn:aws[a-z-]*:kms:[a-z0-9-]+:[0-9]{12}:key/[0-9a-f-]{36}$", var.store_kms_key_arn))
    error_message = "store_kms_key_arn must be null or a KMS key ARN (arn:aws:kms:<region>:<account>:key/<uuid>)."
  }
}

variable "ssh_public_key" {
  description = "OpenSSH public key that may log in as the login user on every instance (infractl's cluster key): the operator reaches the controller with it, and the nodes through the controller."
  type        = string
  nullable    = false

  validation {
    condition     = can(regex("^(ssh-ed25519|ecdsa-sha2-nistp256|ssh-rsa) [A-Za-z0-9+/=]+( .*)?$", var.ssh_public_key))
    error_message = "ssh_public_key must be one OpenSSH public key line (ssh-ed25519 AAAA... comment)."
  }
}

variable "host_key" {
  description = "The cluster's SSH host key pair (OpenSSH private and public key) that user_data installs on every instance, so the operator's known_hosts pins it before any instance exists (never trust on first use)."
  type = object({
    private = string
    public  = string
  })
  sensitive = true
  nullable  = false
}

variable "ssh_ingress_cidrs" {
  description = "IPv4 CIDRs that may reach the controller's SSH port (the cluster's only inbound port): the operator's address, or the range of the machines infractl runs on."
  type        = list(string)
  nullable    = false

  validation {
    condition     = length(var.ssh_ingress_cidrs) >= 1 && alltrue([for cidr in var.ssh_ingress_cidrs : can(cidrhost(cidr, 0))])
    error_message = "ssh_ingress_cidrs needs at least one IPv4 CIDR, such as 203.0.113.7/32."
  }
}

variable "login_user" {
  description = "The user SSH logs in as on every instance (with passwordless sudo): ubuntu on Ubuntu and the deep learning AMIs."
  type        = string
  default     = "ubuntu"
  nullable    = false

  validation {
    condition     = can(regex("^[a-z_][a-z0-9_-]{0,31}$", var.login_user))
    error_message = "login_user must be a Unix user name."
  }
}

variable "public_subnet_id" {
  description = "Existing public subnet (with subnet_id) for the controller, the SSH jump host: it needs a public address. Ignored when the module creates the network."
  type        = string
  default     = null

  validation {
    condition     = var.public_subnet_id == null || can(regex("^subnet-[0-9a-f]{8,17}$", var.public_subnet_id))
    error_message = "public_subnet_id must be null or a subnet id (subnet-0123456789abcdef0)."
  }

  validation {
    condition     = (var.subnet_id == null) || (var.public_subnet_id != null)
    error_message = "public_subnet_id is required with subnet_id: the controller is the SSH jump host and needs a public address."
  }
}

variable "controller_instance_type" {
  description = "Instance type of the controller, the small on-demand instance that serves the rendezvous endpoint. Never a training type: losing a training node must not take the rendezvous with it."
  type        = string
  default     = "m7i.large"
  nullable    = false

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]*\\.[a-z0-9]+$", var.controller_instance_type)) && !contains(keys(local.instance_types), var.controller_instance_type)
    error_message = "controller_instance_type must be an instance type name (such as m7i.large) that is not one of the training types in instances.json."
  }
}

variable "rendezvous_port" {
  description = "TCP port of the rendezvous store on the controller (torchrun --rdzv-endpoint=<controller>:<port>)."
  type        = number
  default     = 29400
  nullable    = false

  validation {
    condition     = var.rendezvous_port >= 1024 && var.rendezvous_port <= 65535 && floor(var.rendezvous_port) == var.rendezvous_port
    error_message = "rendezvous_port must be a whole number from 1024 to 65535."
  }
}

variable "root_volume_gb" {
  description = "Size of each training node's encrypted gp3 root volume in GiB (the deep learning AMI needs about 75)."
  type        = number
  default     = 200
  nullable    = false

  validation {
    condition     = var.root_volume_gb >= 100 && var.root_volume_gb <= 16384 && floor(var.root_volume_gb) == var.root_volume_gb
    error_message = "root_volume_gb must be a whole number from 100 to 16384."
  }
}

variable "workdir" {
  description = "Absolute path of each node's work directory, reported in the inventory. The default is on the local NVMe instance store the deep learning AMI mounts: fast, and wiped when the instance stops (the store keeps what matters)."
  type        = string
  default     = "/opt/dlami/nvme/infractl"
  nullable    = false

  # Root makes it and sets its owner and ACLs, and it reaches shell commands and Ansible's variables: plain
  # segments only, and never / or a top-level directory.
  validation {
    condition     = can(regex("^(/[A-Za-z0-9_][A-Za-z0-9._-]*){2,}$", var.workdir))
    error_message = "workdir must be an absolute path at least two levels deep whose segments are letters, digits, '.', '_' and '-', none starting with '.' or '-'."
  }
}

variable "ami_overrides" {
  description = "AMI per instance type (training types or the controller's), replacing the latest AMI that the type's SSM parameter names. Pin AMIs here to make a cluster reproducible."
  type        = map(string)
  default     = {}
  nullable    = false

  validation {
    condition     = alltrue([for ami in values(var.ami_overrides) : can(regex("^ami-[0-9a-f]{8,17}$", ami))])
    error_message = "ami_overrides values must be AMI ids (ami-0123456789abcdef0)."
  }

  validation {
    condition     = alltrue([for type in keys(var.ami_overrides) : contains(keys(local.instance_types), type) || type == var.controller_instance_type])
    error_message = "ami_overrides keys must be training instance types from instances.json or controller_instance_type."
  }
}

variable "tags" {
  description = "Extra tags for every resource. infractl:cluster is always set to cluster_name and cannot be overridden."
  type        = map(string)
  default     = {}
  nullable    = false
}
