# Values computed from the variables alone: no provider, no resource, no data source is referenced here.
# infractl's dry run (infractl/aws_plan.py) evaluates this file with variables.tf to list the resources the
# module would create, so every count and for_each in the module must be computable from these locals and
# the variables.
locals {
  # The table infractl reads too: GPUs, EFA interfaces and the AMI of each training instance type.
  instance_types = jsondecode(file("${path.module}/instances.json")).instance_types

  # Set last, so the leak sweep's tag cannot be overridden by var.tags.
  tags = merge(var.tags, { "infractl:cluster" = var.cluster_name })

  create_network = var.subnet_id == null

  # One entry per training node, keyed <group>-<index>: growing or shrinking one group never renames
  # (and so never replaces) a node of another.
  nodes = merge([
    for name, group in var.node_groups : {
      for index in range(group.nodes) : "${name}-${index}" => {
        group         = name
        instance_type = group.instance_type
        spot          = group.spot
      }
    }
  ]...)

  # Inventory order: groups by name, then nodes by index (numerically: main-2 before main-10).
  node_order = flatten([
    for name in sort(keys(var.node_groups)) : [for index in range(var.node_groups[name].nodes) : "${name}-${index}"]
  ])

  # One launch template per training instance type in use.
  node_instance_types = toset([for group in values(var.node_groups) : group.instance_type])

  # A cluster placement group only where racks matter: some node has EFA. (CPU and TCP-socket GPU types do
  # not need one, and some EC2-compatible APIs have none.)
  placement_group = anytrue([for type in local.node_instance_types : local.instance_types[type].efa_interfaces > 0])

  # Network interfaces of each launch template, one per network card. 'efa': every card gets an EFA with an
  # IP address (card 0 is the primary interface). 'efa-only': a primary ENA interface on card 0, then an
  # IP-less EFA on card 0 (device 1) and on every further card (device 0), as AWS recommends for P5-class
  # types. interface_type null is a plain ENA interface. No EFA: none here; the instance takes its one
  # interface from its own subnet_id and security groups (aws_instance.node).
  network_interfaces = {
    for type in local.node_instance_types : type => (
      local.instance_types[type].efa_interfaces == 0 ? [] : local.instance_types[type].efa_interface_type == "efa" ? [
        for card in range(local.instance_types[type].efa_interfaces) : {
          network_card_index = card
          device_index       = card == 0 ? 0 : 1
          interface_type     = "efa"
        }
        ] : concat(
        [{ network_card_index = 0, device_index = 0, interface_type = null }],
        [
          for card in range(local.instance_types[type].efa_interfaces) : {
            network_card_index = card
            device_index       = card == 0 ? 1 : 0
            interface_type     = "efa-only"
          }
        ]
      )
    )
  }

  # The AMI of each instance type comes from AWS's public SSM parameter for its latest release, unless pinned
  # in var.ami_overrides. The controller runs Canonical's Ubuntu 24.04 LTS.
  ami_parameters = merge(
    { for type in local.node_instance_types : type => local.instance_types[type].ami_ssm_parameter },
    { (var.controller_instance_type) = "/aws/service/canonical/ubuntu/server/24.04/stable/current/amd64/hvm/ebs-gp3/ami-id" },
  )
  ami_lookups = { for type, parameter in local.ami_parameters : type => parameter if !contains(keys(var.ami_overrides), type) }

  # The controller only serves the rendezvous store: a small root volume is plenty.
  controller_root_volume_gb = 30
}
