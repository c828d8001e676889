"""Print the name of the network interface that carries an IPv4 address (read-only, Linux)."""

import fcntl
import ipaddress
import socket
import struct
import sys

SIOCGIFFLAGS = 0x8913
SIOCGIFADDR = 0x8915
IFF_LOOPBACK = 0x8


def ioctl(sock, request, name):
    return fcntl.ioctl(sock.fileno(), request, struct.pack("256s", name.encode()[:15]))


def main(address):
    wanted = ipaddress.ip_address(address)
    loopbacks = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                flags = struct.unpack("H", ioctl(sock, SIOCGIFFLAGS, name)[16:18])[0]
                if flags & IFF_LOOPBACK:
                    loopbacks.append(name)
                if ipaddress.ip_address(socket.inet_ntoa(ioctl(sock, SIOCGIFADDR, name)[20:24])) == wanted:
                    return name
            except OSError:  # no IPv4 address on this interface
                continue
    # 127.0.0.0/8 is routed over the loopback interface whichever address it carries.
    if wanted.is_loopback and loopbacks:
        return loopbacks[0]
    sys.exit(f"no network interface carries {address}")


if __name__ == "__main__":
    print(main(sys.argv[1]))
