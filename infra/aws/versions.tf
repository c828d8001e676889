terraform {
  # 1.10: the S3 backend's native locking (use_lockfile) in the root module; 1.9: variable validations that
  # refer to other variables and locals.
  required_version = ">= 1.10, < 2.0"

  required_providers {
    aws = {
      source = "hashicorp/aws"
      # 5.100 and 6.x: both take efa-only network interfaces in launch templates and instance_market_options
      # on aws_instance; the module uses no attribute that only one of them has (data.aws_region's name,
      # not 6.x's region).
      version = ">= 5.100, < 7.0"
    }
  }
}
