# Only the training nodes get a role, with one inline policy of exactly what they use: the store. Nothing
# AWS manages is attached:
# - no AmazonSSMManagedInstanceCore: infractl reaches every instance over SSH through the controller, never
#   through Session Manager, and that policy would let anyone on a node read every SSM parameter
#   (ssm:GetParameter* on *) with the instance's credentials;
# - no AmazonEC2ContainerRegistryReadOnly: the nodes pull the trainer image from the cluster's own registry
#   on the controller (infractl/image/registry.py), never from ECR, and that policy reads every repository.
# The controller needs no AWS API at all (it serves the rendezvous store and the registry): it has no role,
# so its metadata service holds no credentials. The role lives under the IAM path /infractl/<cluster>/, so a
# leak sweep finds it by path.

locals {
  iam_path   = "/infractl/${var.cluster_name}/"
  bucket_arn = "arn:${data.aws_partition.current.partition}:s3:::${var.store_bucket}"
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
# The nodes are the only writers of checkpoints (runs/*/ckpt/*): infractl's access roles are denied writing
# there (infractl/store/_iam.py).
data "aws_iam_policy_document" "store" {
  statement {
    sid       = "List"
    actions   = ["s3:ListBucket"]
    resources = [local.bucket_arn]

    # Listing needs the prefix: no listing of the whole bucket. S3 checks ListBucket without a prefix when a
    # GetObject or HeadObject finds no key, so a missing key is a 403 here rather than a 404; the store tells
    # the two apart by listing the key itself (S3Store._missing in infractl/store/s3.py).
    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = ["${var.store_prefix}/*"]
    }
  }

  statement {
    sid       = "Objects"
    actions   = ["s3:AbortMultipartUpload", "s3:DeleteObject", "s3:GetObject", "s3:PutObject"]
    resources = ["${local.bucket_arn}/${var.store_prefix}/*"]
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

resource "aws_iam_instance_profile" "node" {
  name_prefix = "infractl-node-"
  path        = local.iam_path
  role        = aws_iam_role.node.name
  tags        = local.tags
}
