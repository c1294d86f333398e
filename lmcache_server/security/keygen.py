"""``lmcache-server keygen NAME [--dir DIR] [--force]``: a new CURVE key pair.

Writes ``DIR/NAME.key`` (public, 0644: hand it out) and
``DIR/NAME.key_secret`` (both keys, 0600: keep it where only its owner reads
it), in ZeroMQ's certificate format, and prints what to do with them: the
daemon's pair goes to ``server_secret_key_file``, a client's public key into
``client_keys_file``, its secret file to the client (``client_secret_key``).

Exit codes: 0 written, 2 refused (file exists without --force, bad name or
directory).  Primitive: :func:`main`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lmcache_client.curve import KeyFileError, read_public_key, write_keypair


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lmcache-server keygen",
        description="Write a new CURVE key pair: NAME.key (public) and NAME.key_secret (secret, mode 0600).",
        epilog="See docs/security.md for where each file goes.",
    )
    p.add_argument("name", help="file name stem, e.g. server, vllm-a, admin")
    p.add_argument("--dir", default=".", metavar="DIR", help="where to write the files (default: .)")
    p.add_argument("--force", action="store_true", help="replace existing files of that name")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        public_path, secret_path = write_keypair(args.dir, args.name, overwrite=args.force)
    except (KeyFileError, OSError) as err:
        print(f"keygen refused: {err}", file=sys.stderr)
        return 2
    public = read_public_key(str(public_path)).decode()
    print(f"public key  {public_path}  (0644; give it to whoever needs it)")
    print(f"secret key  {secret_path}  (0600; only its owner may read it)")
    print(f"public key (Z85): {public}")
    print()
    print("For the daemon:  server_secret_key_file: " + str(secret_path.resolve()))
    print("                 clients use server_public_key: " + str(public_path.resolve()))
    print("For a client, add to client_keys_file:")
    print(f"  {args.name}:")
    print(f'    public_key: "{public}"')
    print("    grants:")
    print("      - {tenant: TENANT, access: rw}")
    print(f"  and give the client client_secret_key: {secret_path.resolve()}")
    return 0
