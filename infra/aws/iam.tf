# Two roles, each with only what its instances need. Both carry AmazonSSMManagedInstanceCore, AWS's policy
# for Session Manager (how operators and Ansible reach instances that have no inbound port and no public
# address). Roles live under the IAM path /infractl/<cluster>/, so a leak sweep finds them by path.

locals {
  iam_path       = "/infractl/${var.cluster_name}/"
  bucket_arn     = "arn:${data.aws_partition.current.partition}:s3:::${var.store_bucket}"
  ssm_policy_arn = "arn:${data.aws_partition.current.partition}:iam::aws:policy/AmazonSSMManagedInstanceCore"
  ecr_policy_arn = "arn:${data.aws_partition.current.partition}:iam::aws:policy/AmazonEC2ContainerRegistryReadOnly"
}

data "aws_iam_policy_document" "ec2_assume" {
  statement {
    actions = ["sts:AssumeRole"]

    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

# Training nodes: list, read, write and delete objects under the store's prefix, and nothing else in S3.
# The same actions as the operator role of infractl's access policy (infractl/store/_iam.py).
data "aws_iam_policy_document" "store" {
  statement {
    sid       = "List"
    actions   = ["s3:ListBucket"]
    resources = [local.bucket_arn]

    dynamic "condition" {
      for_each = var.store_prefix == "" ? [] : [var.store_prefix]

      # IfExists: S3 also checks ListBucket (without a prefix) when a GetObject finds no key, to answer 404
      # rather than 403; the store needs that 404. Listing with another prefix is still refused.
      content {
        test     = "StringLikeIfExists"
        variable = "s3:prefix"
        values   = [condition.value, "${condition.value}/*"]
      }
    }
  }

  statement {
    sid       = "Objects"
    actions   = ["s3:AbortMultipartUpload", "s3:DeleteObject", "s3:GetObject", "s3:PutObject"]
    resources = ["${local.bucket_arn}/${local.store_keys}"]
  }

  dynamic "statement" {
    for_each = var.store_kms_key_arn == null ? [] : [var.store_kms_key_arn]

    content {
      sid       = "StoreKey"
      actions   = ["kms:Decrypt", "kms:GenerateDataKey"]
      resources = [statement.value]
    }
  }
}

resource "aws_iam_role" "node" {
  name_prefix          = "infractl-node-"
  path                 = local.iam_path
  description          = "infractl cluster ${var.cluster_name}: training nodes"
  assume_role_policy   = data.aws_iam_policy_document.ec2_assume.json
  max_session_duration = 3600
  tags                 = local.tags
}

resource "aws_iam_role_policy" "node_store" {
  name   = "store"
  role   = aws_iam_role.node.id
  policy = data.aws_iam_policy_document.store.json
}

resource "aws_iam_role_policy_attachment" "node_ssm" {
  role       = aws_iam_role.node.name
  policy_arn = local.ssm_policy_arn
}

# Pull the trainer image from ECR with the instance's own credentials (no keys copied to nodes).
resource "aws_iam_role_policy_attachment" "node_ecr" {
  role       = aws_iam_role.node.name
  policy_arn = local.ecr_policy_arn
}

resource "aws_iam_instance_profile" "node" {
  name_prefix = "infractl-node-"
  path        = local.iam_path
  role        = aws_iam_role.node.name
  tags        = local.tags
}

# The controller serves the rendezvous store only: Session Manager, no data access.
resource "aws_iam_role" "controller" {
  name_prefix          = "infractl-controller-"
  path                 = local.iam_path
  description          = "infractl cluster ${var.cluster_name}: rendezvous controller"
  assume_role_policy   = data.aws_iam_policy_document.ec2_assume.json
  max_session_duration = 3600
  tags                 = local.tags
}

resource "aws_iam_role_policy_attachment" "controller_ssm" {
  role       = aws_iam_role.controller.name
  policy_arn = local.ssm_policy_arn
}

resource "aws_iam_instance_profile" "controller" {
  name_prefix = "infractl-controller-"
  path        = local.iam_path
  role        = aws_iam_role.controller.name
  tags        = local.tags
}
