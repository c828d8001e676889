output "inventory" {
  description = "The training nodes in inventory order (groups by name, then index), in the shape of infra/local's inventory: name (<group>-<index>), address (private IP, what peers and the controller use), workdir and processes; plus instance_id, group, instance_type, spot and availability_zone."
  value = [
    for name in local.node_order : {
      name              = name
      address           = aws_instance.node[name].private_ip
      workdir           = var.workdir
      processes         = coalesce(var.processes_per_node, max(1, local.instance_types[local.nodes[name].instance_type].gpus))
      instance_id       = aws_instance.node[name].id
      group             = local.nodes[name].group
      instance_type     = local.nodes[name].instance_type
      spot              = local.nodes[name].spot
      availability_zone = aws_instance.node[name].availability_zone
    }
  ]
}

output "controller" {
  description = "The controller instance: instance_id, address (private IP, what the nodes use), public_address (the SSH jump host's) and login_user."
  value = {
    instance_id    = aws_instance.controller.id
    address        = aws_instance.controller.private_ip
    public_address = aws_instance.controller.public_ip
    login_user     = var.login_user
  }
}

output "rendezvous_endpoint" {
  description = "host:port of the rendezvous store on the controller, for torchrun --rdzv-endpoint."
  value       = "${aws_instance.controller.private_ip}:${var.rendezvous_port}"
}

output "bucket" {
  description = "Name of the store's bucket (created by the module when create_bucket is set)."
  value       = try(aws_s3_bucket.this[0].bucket, var.store_bucket)
}

output "store_url" {
  description = "The store's URI, s3://<bucket>/<prefix>, as infractl's store configuration takes it."
  value       = trimsuffix("s3://${try(aws_s3_bucket.this[0].bucket, var.store_bucket)}/${var.store_prefix}", "/")
}

output "network" {
  description = "Where the instances run: vpc_id, subnet_id, security_group_id and placement_group."
  value = {
    vpc_id            = local.vpc_id
    subnet_id         = local.subnet_id
    security_group_id = aws_security_group.this.id
    placement_group   = try(aws_placement_group.this[0].name, null)
  }
}

output "node_role_arn" {
  description = "ARN of the training nodes' IAM role (store access under store_prefix, nothing else)."
  value       = aws_iam_role.node.arn
}
