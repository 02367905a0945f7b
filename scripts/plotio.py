"""Shared by the plot scripts: write a matplotlib figure as PNG atomically.

The PNG goes to a temporary file in the destination's directory and is
renamed over the destination, so a reader never sees a partial file and an
interrupted run leaves the previous plot intact.
"""
import os
import tempfile

import matplotlib.pyplot as plt


def save_png_atomic(fig, path, **savefig_kwargs):
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".plot-", suffix=".png", dir=directory)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it 0600; a plot is an ordinary file
    try:
        fig.savefig(tmp, format="png", **savefig_kwargs)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
        plt.close(fig)
