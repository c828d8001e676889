"""The ``ssh`` provider: the team's own machines, reached over SSH with pinned host keys.

- ``spec.py``: cluster.yaml's ``ssh:`` section (hosts, login, jump host, known_hosts, controller).
- ``hosts.py``: what infractl asks of and does to a host directly: the preflight, the key scan, the
  cleaning at teardown and gc, and this machine's record of the hosts.
- ``provider.py``: the ``Ssh`` provider and its node control (``SshHosts``).
"""

from infractl.providers.ssh.provider import Ssh

__all__ = ["Ssh"]
