terraform {
  # terraform_data and provisioners are built in: this module needs no provider download.
  required_version = ">= 1.4, < 2.0"
}
