#!/usr/bin/env python3
"""List, or blank, the per-architecture SASS in a CUDA shared library's fatbins.

  python3 bench/gpu/kit/fatbin_prune.py list LIB.so
  python3 bench/gpu/kit/fatbin_prune.py prune LIB.so OUT.so 90      # keep sm_90 SASS only

`prune` overwrites with zeros the payload of every ELF (SASS) entry whose arch
is not in the list; every entry header, every PTX entry and the file's layout
and size stay exactly as they were, so nothing that points into the file moves.
The CUDA driver picks one entry per fatbin for the device (sm_90 SASS on an
H100/H200, else PTX to JIT) and reads only that one, so on sm_90 the pruned
library behaves like the original; on any other GPU it would fail. The point
is size: vLLM 0.26's _C_stable_libtorch.abi3.so (78.8 MB) holds its fatbins
zstd-compressed, so xz gets it only to 55.8 MB; pruned it xz-compresses to
25.7 MB, about half of the whole kit's size saved.

Fatbin layout used (public reverse-engineering, e.g. cuda-fatbin-decompression):
  header  <I magic 0xBA55ED50><H version 1><H header_size 16><Q payload_size>
  entry   <H kind 1=PTX 2=ELF><H ?><I header_size><Q size> ... arch at +28
"""
import collections
import struct
import sys

MAGIC = struct.pack("<I", 0xBA55ED50)


def walk(data):
    pos = 0
    while True:
        i = data.find(MAGIC, pos)
        if i < 0:
            return
        _, ver, hsz, fsz = struct.unpack_from("<IHHQ", data, i)
        if ver != 1 or hsz != 16:
            pos = i + 4
            continue
        p, end = i + hsz, i + hsz + fsz
        while p < end:
            kind, _, ehs, size = struct.unpack_from("<HHIQ", data, p)
            arch = struct.unpack_from("<I", data, p + 28)[0]
            yield kind, arch, p + ehs, size
            p += ehs + size
        if p != end:
            raise SystemExit(f"fatbin at {i}: entries overrun ({p} != {end}); unknown layout")
        pos = end


def main():
    if len(sys.argv) >= 3 and sys.argv[1] == "list":
        data = open(sys.argv[2], "rb").read()
        tot = collections.Counter()
        n = collections.Counter()
        for kind, arch, _, size in walk(data):
            key = ({1: "PTX", 2: "ELF"}.get(kind, str(kind)), arch)
            tot[key] += size
            n[key] += 1
        print(f"{sys.argv[2]}: {len(data)} bytes")
        for key in sorted(tot):
            print(f"  {key[0]} sm_{key[1]}: {n[key]} entries, {tot[key]} bytes")
    elif len(sys.argv) == 5 and sys.argv[1] == "prune":
        src, dst = sys.argv[2], sys.argv[3]
        keep = {int(a) for a in sys.argv[4].split(",")}
        data = bytearray(open(src, "rb").read())
        zeroed = kept = 0
        for kind, arch, off, size in list(walk(bytes(data))):
            if kind == 2 and arch not in keep:
                data[off:off + size] = bytes(size)
                zeroed += size
            else:
                kept += size
        open(dst, "wb").write(data)
        print(f"{src} -> {dst}: blanked {zeroed} bytes of SASS, kept {kept} bytes (SASS for {sorted(keep)} and all PTX)")
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
