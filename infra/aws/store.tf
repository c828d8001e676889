# The store's bucket, when the cluster creates it (create_bucket). An existing bucket is left as it is: the
# nodes' role is scoped to it either way (iam.tf).

resource "aws_s3_bucket" "this" {
  #checkov:skip=CKV_AWS_18:Server access logs would need a second bucket per cluster; object-level auditing is CloudTrail data events, an account-wide choice.
  #checkov:skip=CKV2_AWS_62:Nothing consumes bucket events: infractl reads the store by listing and reading run records.
  #checkov:skip=CKV_AWS_144:Checkpoints live as long as a run and can be recomputed; replication would double storage and transfer cost. A team that needs it replicates an existing bucket and passes it with create_bucket = false.
  count = var.create_bucket ? 1 : 0

  bucket        = var.store_bucket
  force_destroy = var.bucket_force_destroy
  tags          = local.tags
}

resource "aws_s3_bucket_ownership_controls" "this" {
  count = var.create_bucket ? 1 : 0

  bucket = aws_s3_bucket.this[0].id

  # No ACLs: access is decided by IAM and the bucket policy alone.
  rule {
    object_ownership = "BucketOwnerEnforced"
  }
}

resource "aws_s3_bucket_public_access_block" "this" {
  count = var.create_bucket ? 1 : 0

  bucket                  = aws_s3_bucket.this[0].id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_versioning" "this" {
  count = var.create_bucket ? 1 : 0

  bucket = aws_s3_bucket.this[0].id

  versioning_configuration {
    status = "Enabled"
  }
}

# SSE-KMS with the AWS-managed key (aws/s3): the nodes' S3 permissions are enough to use it, and the bucket
# key keeps KMS requests (and their cost) per object rather than per part.
resource "aws_s3_bucket_server_side_encryption_configuration" "this" {
  count = var.create_bucket ? 1 : 0

  bucket = aws_s3_bucket.this[0].id

  rule {
    bucket_key_enabled = true

    apply_server_side_encryption_by_default {
      sse_algorithm = "aws:kms"
    }
  }
}

# Requests without TLS, or below TLS 1.2, are refused (unless require_tls is off: an endpoint without TLS).
data "aws_iam_policy_document" "bucket" {
  count = var.create_bucket && var.require_tls ? 1 : 0

  statement {
    sid     = "DenyInsecureTransport"
    effect  = "Deny"
    actions = ["s3:*"]
    resources = [
      aws_s3_bucket.this[0].arn,
      "${aws_s3_bucket.this[0].arn}/*",
    ]

    principals {
      type        = "*"
      identifiers = ["*"]
    }

    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }

  statement {
    sid     = "DenyOutdatedTLS"
    effect  = "Deny"
    actions = ["s3:*"]
    resources = [
      aws_s3_bucket.this[0].arn,
      "${aws_s3_bucket.this[0].arn}/*",
    ]

    principals {
      type        = "*"
      identifiers = ["*"]
    }

    condition {
      test     = "NumericLessThan"
      variable = "s3:TlsVersion"
      values   = ["1.2"]
    }
  }
}

resource "aws_s3_bucket_policy" "this" {
  count = var.create_bucket && var.require_tls ? 1 : 0

  bucket = aws_s3_bucket.this[0].id
  policy = data.aws_iam_policy_document.bucket[0].json

  # A bucket policy put while public access blocks are being set can be refused; set them first.
  depends_on = [aws_s3_bucket_public_access_block.this]
}

resource "aws_s3_bucket_lifecycle_configuration" "this" {
  count = var.create_bucket ? 1 : 0

  bucket = aws_s3_bucket.this[0].id

  rule {
    id     = "tidy"
    status = "Enabled"

    filter {}

    # A killed upload (a node lost mid-checkpoint) leaves parts that are billed until aborted.
    abort_incomplete_multipart_upload {
      days_after_initiation = 1
    }

    # Checkpoint retention deletes old steps; versioning keeps them as noncurrent versions until this.
    noncurrent_version_expiration {
      noncurrent_days = var.noncurrent_version_days
    }

    expiration {
      expired_object_delete_marker = true
    }
  }

  depends_on = [aws_s3_bucket_versioning.this]
}
