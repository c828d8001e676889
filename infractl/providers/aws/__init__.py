"""The ``aws`` provider: GPU instances made by infra/aws, reached over SSH through the cluster's
controller, configured by Ansible, training in the pinned container image.

- ``spec``: cluster.yaml's ``aws:`` section, its checks, and infra/aws's variables and tables.
- ``pricing``: what ``up --dry-run`` would create and what it costs per hour, offline.
- ``account``: what the account must offer before ``up`` changes anything (credentials, buckets,
  instance types, quotas).
- ``buckets``: the Terraform state bucket (its key, its lock) and the store's bucket (emptied for
  a purge).
- ``sweep``: what the account still holds with the cluster's tag after ``terraform destroy``, and
  the deletion of what an interrupted ``up`` made before Terraform saved its state.
- ``ssh``: the cluster's SSH keys, each instance's own host key, the wait for SSH.
- ``nodes``: node control of the instances (``AwsNodes``), their container engines, and what the
  apply learnt of them (``<state>/aws.json``).
- ``provider``: the ``Provider`` itself, which the ``infractl.providers`` entry point names.
"""
