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
}

# EFA and NCCL need every kind of traffic between the nodes; nothing else may reach them. Nodes are reached
# through Session Manager, which needs no inbound rule.
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

# Out to the internet only over HTTP(S), through the NAT gateway: Session Manager, S3, the image registry and
# package mirrors (Ubuntu's archive is served over HTTP, signed).
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

# Nodes on as few racks as AWS can give: EFA's latency and bandwidth depend on it.
resource "aws_placement_group" "this" {
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
  key_name               = var.key_name
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

  placement {
    group_name = aws_placement_group.this.name
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

  # No public address. AWS refuses the setting altogether (even false) on a launch with several network
  # interfaces, which never get a public address anyway; a single interface says no explicitly, in case an
  # existing subnet assigns public addresses by default.
  dynamic "network_interfaces" {
    for_each = local.network_interfaces[each.key]

    content {
      network_card_index          = network_interfaces.value.network_card_index
      device_index                = network_interfaces.value.device_index
      interface_type              = network_interfaces.value.interface_type
      subnet_id                   = local.subnet_id
      security_groups             = [aws_security_group.this.id]
      associate_public_ip_address = length(local.network_interfaces[each.key]) == 1 ? false : null
      delete_on_termination       = true
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

# The rendezvous endpoint lives here, never on a training node: torchrun's c10d store is a single point of
# failure on whichever host serves it. Always on-demand, outside the placement group.
resource "aws_instance" "controller" {
  ami                    = local.ami[var.controller_instance_type]
  instance_type          = var.controller_instance_type
  subnet_id              = local.subnet_id
  vpc_security_group_ids = [aws_security_group.this.id]
  iam_instance_profile   = aws_iam_instance_profile.controller.name
  key_name               = var.key_name
  ebs_optimized          = true
  monitoring             = true

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
