terraform {
  # 1.10: the S3 backend's native locking (use_lockfile) in the root module; 1.9: variable validations that
  # refer to other variables and locals.
  required_version = ">= 1.10, < 2.0"

  required_providers {
    aws = {
      source = "hashicorp/aws"
      # 6.x: launch templates accept efa-only network interfaces and aws_instance takes instance_market_options.
      version = ">= 6.0, < 7.0"
    }
  }
}
