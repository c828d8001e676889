# The network the module creates when no subnet_id is given: a private subnet for every instance (no public
# addresses: nodes with several network cards cannot get one anyway), a public subnet holding the NAT
# gateway for outbound traffic, and an S3 gateway endpoint so checkpoint traffic skips the NAT gateway
# (free, where the NAT gateway charges per GB).

resource "aws_vpc" "this" {
  #checkov:skip=CKV2_AWS_11:This VPC lives as long as the cluster and admits no inbound traffic but SSH to the controller from ssh_ingress_cidrs; flow logs would add a KMS key, a log group kept a year and a role to every cluster. Pass vpc_id and subnet_id to run in an audited VPC with flow logs.
  count = local.create_network ? 1 : 0

  cidr_block           = var.vpc_cidr
  enable_dns_support   = true
  enable_dns_hostnames = true
  tags                 = merge(local.tags, { Name = "infractl-${var.cluster_name}" })
}

# Take the default security group's rules away: nothing may use it by accident.
resource "aws_default_security_group" "this" {
  count = local.create_network ? 1 : 0

  vpc_id = aws_vpc.this[0].id
  tags   = merge(local.tags, { Name = "infractl-${var.cluster_name}-default-unused" })
}

resource "aws_subnet" "private" {
  count = local.create_network ? 1 : 0

  vpc_id                  = aws_vpc.this[0].id
  cidr_block              = cidrsubnet(var.vpc_cidr, 4, 0)
  availability_zone       = var.availability_zone
  map_public_ip_on_launch = false
  tags                    = merge(local.tags, { Name = "infractl-${var.cluster_name}-nodes" })
}

resource "aws_subnet" "public" {
  count = local.create_network ? 1 : 0

  vpc_id                  = aws_vpc.this[0].id
  cidr_block              = cidrsubnet(var.vpc_cidr, 4, 1)
  availability_zone       = var.availability_zone
  map_public_ip_on_launch = false
  tags                    = merge(local.tags, { Name = "infractl-${var.cluster_name}-nat" })
}

resource "aws_internet_gateway" "this" {
  count = local.create_network ? 1 : 0

  vpc_id = aws_vpc.this[0].id
  tags   = merge(local.tags, { Name = "infractl-${var.cluster_name}" })
}

resource "aws_eip" "nat" {
  count = local.create_network ? 1 : 0

  domain = "vpc"
  tags   = merge(local.tags, { Name = "infractl-${var.cluster_name}-nat" })

  depends_on = [aws_internet_gateway.this]
}

resource "aws_nat_gateway" "this" {
  count = local.create_network ? 1 : 0

  allocation_id = aws_eip.nat[0].id
  subnet_id     = aws_subnet.public[0].id
  tags          = merge(local.tags, { Name = "infractl-${var.cluster_name}" })

  depends_on = [aws_internet_gateway.this]
}

resource "aws_route_table" "public" {
  count = local.create_network ? 1 : 0

  vpc_id = aws_vpc.this[0].id
  tags   = merge(local.tags, { Name = "infractl-${var.cluster_name}-nat" })

  route {
    cidr_block = "0.0.0.0/0"
    gateway_id = aws_internet_gateway.this[0].id
  }
}

resource "aws_route_table_association" "public" {
  count = local.create_network ? 1 : 0

  subnet_id      = aws_subnet.public[0].id
  route_table_id = aws_route_table.public[0].id
}

resource "aws_route_table" "private" {
  count = local.create_network ? 1 : 0

  vpc_id = aws_vpc.this[0].id
  tags   = merge(local.tags, { Name = "infractl-${var.cluster_name}-nodes" })

  route {
    cidr_block     = "0.0.0.0/0"
    nat_gateway_id = aws_nat_gateway.this[0].id
  }
}

resource "aws_route_table_association" "private" {
  count = local.create_network ? 1 : 0

  subnet_id      = aws_subnet.private[0].id
  route_table_id = aws_route_table.private[0].id
}

resource "aws_vpc_endpoint" "s3" {
  count = local.create_network ? 1 : 0

  vpc_id            = aws_vpc.this[0].id
  service_name      = "com.amazonaws.${data.aws_region.current.name}.s3"
  vpc_endpoint_type = "Gateway"
  route_table_ids   = [aws_route_table.private[0].id]
  tags              = merge(local.tags, { Name = "infractl-${var.cluster_name}-s3" })
}
