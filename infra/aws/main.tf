data "aws_partition" "current" {}

data "aws_region" "current" {}

data "aws_ssm_parameter" "ami" {
  for_each = local.ami_lookups

  name = each.value
}

locals {
  vpc_id    = local.create_network ? aws_vpc.this[0].id : var.vpc_id
  subnet_id = local.create_network ? aws_subnet.private[0].id : var.subnet_id
  # insecure_value: these public parameters are plain AMI ids, not secrets.
  ami = merge({ for type, parameter in data.aws_ssm_parameter.ami : type => parameter.insecure_value }, var.ami_overrides)

  # The controller is the SSH jump host: in the public subnet, with a public address.
  controller_subnet_id = local.create_network ? aws_subnet.public[0].id : var.public_subnet_id

  # cloud-init on every instance: the cluster's bootstrap host key in place of generated ones (the operator
  # pinned it before the instance existed), and the cluster's key for the login user. The bootstrap key is
  # every new instance's, and anyone who reads user data has it: the first `infractl up` that reaches an
  # instance has it make a host key of its own over the channel pinned to the bootstrap key, and pins that
  # one for it instead (Aws.provisioned in infractl/providers/aws/provider.py).
  user_data = join("\n", ["#cloud-config", yamlencode({
    ssh_deletekeys      = true
    ssh_genkeytypes     = []
    ssh_keys            = { ed25519_private = var.host_key.private, ed25519_public = var.host_key.public }
    ssh_authorized_keys = [var.ssh_public_key]
  })])
}

resource "aws_key_pair" "cluster" {
  key_name_prefix = "infractl-${var.cluster_name}-"
  public_key      = var.ssh_public_key
  tags            = local.tags
}

# EFA and NCCL need every kind of traffic between the nodes; nothing else may reach them. Nodes are reached
# over SSH through the controller (a member).
resource "aws_security_group" "this" {
  name_prefix = "infractl-${var.cluster_name}-"
  description = "infractl cluster ${var.cluster_name}: all traffic between members only, HTTP(S) out"
  vpc_id      = local.vpc_id
  tags        = merge(local.tags, { Name = "infractl-${var.cluster_name}" })

  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_vpc_security_group_ingress_rule" "members" {
  security_group_id            = aws_security_group.this.id
  description                  = "All traffic from cluster members (EFA, NCCL, rendezvous)"
  referenced_security_group_id = aws_security_group.this.id
  ip_protocol                  = "-1"
  tags                         = local.tags
}

resource "aws_vpc_security_group_egress_rule" "members" {
  security_group_id            = aws_security_group.this.id
  description                  = "All traffic to cluster members (EFA needs it in both directions)"
  referenced_security_group_id = aws_security_group.this.id
  ip_protocol                  = "-1"
  tags                         = local.tags
}

# Out to the internet only over HTTP(S), through the NAT gateway: S3 and package mirrors (Ubuntu's archive is
# served over HTTP, signed).
resource "aws_vpc_security_group_egress_rule" "web" {
  for_each = toset(["80", "443"])

  security_group_id = aws_security_group.this.id
  description       = "Outbound TCP ${each.key}"
  cidr_ipv4         = "0.0.0.0/0"
  ip_protocol       = "tcp"
  from_port         = tonumber(each.key)
  to_port           = tonumber(each.key)
  tags              = local.tags
}

# SSH to the controller, the jump host, from where the operator runs infractl: the cluster's only inbound port.
resource "aws_security_group" "jump" {
  name_prefix = "infractl-${var.cluster_name}-ssh-"
  description = "infractl cluster ${var.cluster_name}: SSH to the controller from ssh_ingress_cidrs"
  vpc_id      = local.vpc_id
  tags        = merge(local.tags, { Name = "infractl-${var.cluster_name}-ssh" })

  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_vpc_security_group_ingress_rule" "ssh" {
  for_each = toset(var.ssh_ingress_cidrs)

  security_group_id = aws_security_group.jump.id
  description       = "SSH from ${each.key}"
  cidr_ipv4         = each.key
  ip_protocol       = "tcp"
  from_port         = 22
  to_port           = 22
  tags              = local.tags
}

# Nodes on as few racks as AWS can give: EFA's latency and bandwidth depend on it.
resource "aws_placement_group" "this" {
  count = local.placement_group ? 1 : 0

  name     = "infractl-${var.cluster_name}"
  strategy = "cluster"
  tags     = local.tags
}

resource "aws_launch_template" "node" {
  for_each = local.node_instance_types

  name_prefix            = "infractl-${var.cluster_name}-${replace(each.key, ".", "-")}-"
  description            = "infractl cluster ${var.cluster_name}: ${each.key} training nodes"
  image_id               = local.ami[each.key]
  instance_type          = each.key
  key_name               = aws_key_pair.cluster.key_name
  user_data              = base64encode(local.user_data)
  ebs_optimized          = true
  update_default_version = true
  tags                   = local.tags

  iam_instance_profile {
    arn = aws_iam_instance_profile.node.arn
  }

  # IMDSv2 only. One hop: containers reach the instance's credentials only with host networking, which the
  # trainer uses anyway (EFA needs it).
  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
  }

  monitoring {
    enabled = true
  }

  dynamic "placement" {
    for_each = aws_placement_group.this

    content {
      group_name = placement.value.name
    }
  }

  # Ubuntu AMIs (the deep learning AMI included) boot from /dev/sda1.
  block_device_mappings {
    device_name = "/dev/sda1"

    ebs {
      volume_size           = var.root_volume_gb
      volume_type           = "gp3"
      encrypted             = true
      delete_on_termination = true
    }
  }

  # EFA types only: their interface layout. No public address: a launch with several network interfaces
  # never gets one (and AWS refuses the setting, even false, on such a launch).
  dynamic "network_interfaces" {
    for_each = local.network_interfaces[each.key]

    content {
      network_card_index    = network_interfaces.value.network_card_index
      device_index          = network_interfaces.value.device_index
      interface_type        = network_interfaces.value.interface_type
      subnet_id             = local.subnet_id
      security_groups       = [aws_security_group.this.id]
      delete_on_termination = true
    }
  }

  tag_specifications {
    resource_type = "volume"
    tags          = local.tags
  }

  tag_specifications {
    resource_type = "network-interface"
    tags          = local.tags
  }

  lifecycle {
    # The AMI is fixed when the template is created: a new AMI release must not replace running nodes, and
    # nodes added later must match the others (driver, NCCL, EFA). Pin or change AMIs with ami_overrides and
    # a new cluster.
    ignore_changes = [image_id]
  }
}

resource "aws_instance" "node" {
  # checkov reads these settings on the instance only; here they come from its launch template.
  #checkov:skip=CKV_AWS_79:IMDSv2 is required by the launch template (aws_launch_template.node metadata_options).
  #checkov:skip=CKV_AWS_8:The root volume is encrypted by the launch template (block_device_mappings ebs).
  #checkov:skip=CKV_AWS_126:Detailed monitoring is enabled by the launch template (monitoring).
  #checkov:skip=CKV_AWS_135:EBS optimization is set by the launch template (ebs_optimized).
  #checkov:skip=CKV2_AWS_41:The IAM instance profile is set by the launch template (iam_instance_profile).
  for_each = local.nodes

  launch_template {
    id      = aws_launch_template.node[each.value.instance_type].id
    version = aws_launch_template.node[each.value.instance_type].latest_version
  }

  # Types without EFA have one interface, set here (their launch template has none): in the nodes' subnet, no
  # public address even where an existing subnet assigns them by default.
  subnet_id                   = length(local.network_interfaces[each.value.instance_type]) == 0 ? local.subnet_id : null
  vpc_security_group_ids      = length(local.network_interfaces[each.value.instance_type]) == 0 ? [aws_security_group.this.id] : null
  associate_public_ip_address = length(local.network_interfaces[each.value.instance_type]) == 0 ? false : null

  # A reclaimed spot node is terminated, not stopped: the run continues on the others (elastic rendezvous)
  # and the next `infractl up` creates its replacement.
  dynamic "instance_market_options" {
    for_each = each.value.spot ? ["spot"] : []

    content {
      market_type = "spot"

      spot_options {
        instance_interruption_behavior = "terminate"
        spot_instance_type             = "one-time"
      }
    }
  }

  tags = merge(local.tags, {
    Name             = "infractl-${var.cluster_name}-${each.key}"
    "infractl:node"  = each.key
    "infractl:group" = each.value.group
  })
}

# The rendezvous endpoint (and the cluster's image registry) lives here, never on a training node: torchrun's
# c10d store is a single point of failure on whichever host serves it. It is also the SSH jump host to the
# nodes. Always on-demand, outside the placement group.
resource "aws_instance" "controller" {
  #checkov:skip=CKV_AWS_88:The controller is the SSH jump host: its public address admits SSH from ssh_ingress_cidrs only.
  #checkov:skip=CKV_AWS_126:Basic monitoring is enough for the controller, which trains nothing.
  #checkov:skip=CKV2_AWS_41:The controller calls no AWS API; without a role its metadata service holds no credentials for anyone on it.
  ami                         = local.ami[var.controller_instance_type]
  instance_type               = var.controller_instance_type
  subnet_id                   = local.controller_subnet_id
  associate_public_ip_address = true
  vpc_security_group_ids      = [aws_security_group.this.id, aws_security_group.jump.id]
  key_name                    = aws_key_pair.cluster.key_name
  user_data                   = local.user_data
  ebs_optimized               = true
  # Basic monitoring: the controller only serves the rendezvous store and the registry; detailed metrics
  # are for the training nodes (their launch template).
  monitoring = false

  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
  }

  root_block_device {
    volume_size           = local.controller_root_volume_gb
    volume_type           = "gp3"
    encrypted             = true
    delete_on_termination = true
    tags                  = local.tags
  }

  tags = merge(local.tags, {
    Name            = "infractl-${var.cluster_name}-controller"
    "infractl:role" = "controller"
  })

  lifecycle {
    # Same reason as the nodes' launch templates: a new Ubuntu release must not replace the rendezvous host.
    ignore_changes = [ami]
  }
}
