# A root module around infra/aws: what infractl writes for an AWS cluster, and what an operator runs by hand.
# Two things belong to the root, never to the module: the backend (remote state) and the provider (region,
# default tags).
#
#   terraform init \
#     -backend-config="bucket=<state bucket>" \
#     -backend-config="key=infractl/<cluster>/terraform.tfstate" \
#     -backend-config="region=us-east-1"
#   terraform apply -var="cluster_name=<cluster>" -var="store_bucket=<store bucket>" \
#     -var="ssh_public_key=$(cat key.pub)" -var="ssh_ingress_cidrs=[\"<your address>/32\"]" \
#     -var='host_key={private="<host key>", public="<host key .pub>"}'
# (infractl generates both keys in the cluster's state directory and writes this root module itself.)
#
# The state bucket exists before any cluster (it holds every cluster's state) and is not the store's bucket,
# which a cluster may create and destroy.

terraform {
  required_version = ">= 1.10, < 2.0"

  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.100, < 7.0"
    }
  }

  # State in S3, encrypted, locked with S3's conditional writes (a lock file next to the state; no DynamoDB
  # table). Bucket, key and region are given at init, so one configuration serves every cluster.
  backend "s3" {
    use_lockfile = true
    encrypt      = true
  }
}

variable "region" {
  description = "AWS region of the cluster."
  type        = string
  default     = "us-east-1"
}

variable "availability_zone" {
  description = "Availability zone of the cluster's subnet."
  type        = string
  default     = "us-east-1a"
}

variable "cluster_name" {
  description = "Name of the cluster (1-40 of a-z, 0-9 and '-')."
  type        = string
}

variable "store_bucket" {
  description = "S3 bucket of the cluster's store; created with the cluster here."
  type        = string
}

variable "ssh_public_key" {
  description = "OpenSSH public key that logs in to every instance (ssh-ed25519 AAAA...)."
  type        = string
}

variable "host_key" {
  description = "The SSH host key pair every instance gets (user_data installs it; pin its public half in known_hosts)."
  type = object({
    private = string
    public  = string
  })
  sensitive = true
}

variable "ssh_ingress_cidrs" {
  description = "Where SSH to the controller, the jump host, may come from (e.g. [\"203.0.113.7/32\"])."
  type        = list(string)
}

provider "aws" {
  region = var.region

  # Tags on every taggable resource the provider creates, including ones the module does not tag itself.
  default_tags {
    tags = {
      "infractl:cluster"    = var.cluster_name
      "infractl:managed-by" = "infractl"
    }
  }
}

module "cluster" {
  source = "../.."

  cluster_name      = var.cluster_name
  availability_zone = var.availability_zone
  node_groups = {
    core    = { instance_type = "p5.48xlarge", nodes = 2 }
    elastic = { instance_type = "p5.48xlarge", nodes = 2, spot = true }
  }
  store_bucket      = var.store_bucket
  store_prefix      = "infractl"
  create_bucket     = true
  ssh_public_key    = var.ssh_public_key
  host_key          = var.host_key
  ssh_ingress_cidrs = var.ssh_ingress_cidrs
}

output "inventory" {
  description = "The training nodes."
  value       = module.cluster.inventory
}

output "rendezvous_endpoint" {
  description = "host:port for torchrun --rdzv-endpoint."
  value       = module.cluster.rendezvous_endpoint
}

output "store_url" {
  description = "The store's URI."
  value       = module.cluster.store_url
}
