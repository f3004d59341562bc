"""EXL2 conversions of the bench's random-weight checkpoints, made by exllamav2's own
converter (tensor parallelism in exllamav2 splits only EXL2 weights)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

# Short calibration rows: the weights are random, so the conversion's quality does not
# matter, only that exllamav2 wrote it; 256-token rows keep an 8B conversion to minutes.
CALIBRATION = ["-r", "4", "-l", "256", "-mr", "2", "-ml", "256"]


def convert_exl2(fp16: Path, out: Path, bits: float = 4.0, timeout: float = 1800) -> float:
    """Quantize the fp16 checkpoint ``fp16`` to ``bits`` per weight into ``out`` (kept if
    already there); returns the conversion's seconds (0 when kept). RuntimeError with the
    converter's last output if it fails."""
    if (out / "config.json").exists():
        return 0.0
    work = out.with_name(out.name + "-work")
    command = [sys.executable, "-m", "exllamav2.conversion.convert_exl2", "-b", str(bits)]
    command += ["-i", str(fp16), "-o", str(work), "-cf", str(out), "-nr", *CALIBRATION]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0 or not (out / "config.json").exists():  # it exits 0 on bad args
        raise RuntimeError(
            f"exllamav2's converter failed ({done.returncode}), writing no model:\n"
            + done.stdout[-3000:]
            + done.stderr[-3000:]
        )
    return time.perf_counter() - started


def exl2_checkpoint(models: Path, shape: str, bits: float) -> tuple[Path, float]:
    """The bench's ``shape`` quantized to ``bits`` under ``models`` (converted once), and
    the conversion's seconds (0 when it was already there)."""
    from bench.features import checkpoint

    out = models / f"llama-{shape}-exl2-{bits}bpw"
    return out, convert_exl2(checkpoint(models, shape), out, bits)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="8b")
    parser.add_argument("--bits", type=float, default=4.0)
    parser.add_argument("--models", type=Path, default=Path("/tmp/exlq-models"))
    args = parser.parse_args(argv)
    out, seconds = exl2_checkpoint(args.models, args.shape, args.bits)
    print(f"{out}: converted in {seconds:.0f} s", flush=True)


if __name__ == "__main__":
    main()
