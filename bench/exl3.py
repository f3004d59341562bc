"""EXL3 conversions of the bench's random-weight checkpoints, made by exllamav3's own
converter, on one GPU or several (its --devices: each layer's tensors quantized in
parallel).

    python -m bench.exl3 --shape 8b --bits 4.0 --devices 0,1,2,3
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

# Fewer calibration rows than exllamav3's 250: the weights are random, so the conversion's
# quality does not matter, only that exllamav3 wrote it; its time is mostly quantization.
CALIBRATION = ["-cr", "64"]


def convert_exl3(
    fp16: Path, out: Path, bits: float = 4.0, devices: str = "0", timeout: float = 3600
) -> float:
    """Quantize the fp16 checkpoint ``fp16`` to ``bits`` per weight into ``out`` (kept if
    already there) on the GPUs ``devices`` (indices, comma-separated); returns the
    conversion's seconds (0 when kept). RuntimeError with the converter's last output if it
    fails."""
    if (out / "config.json").exists():
        return 0.0
    work = out.with_name(out.name + "-work")
    command = [sys.executable, "-m", "exllamav3.conversion.convert_model", "-b", str(bits)]
    command += ["-i", str(fp16), "-o", str(out), "-w", str(work), "-d", devices, *CALIBRATION]
    if work.exists():
        command.append("-r")  # an interrupted conversion goes on where it stopped
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0 or not (out / "config.json").exists():
        raise RuntimeError(
            f"exllamav3's converter failed ({done.returncode}), writing no model:\n"
            + done.stdout[-3000:]
            + done.stderr[-3000:]
        )
    return time.perf_counter() - started


def exl3_checkpoint(models: Path, shape: str, bits: float, devices: str) -> tuple[Path, float]:
    """The bench's ``shape`` quantized to ``bits`` under ``models`` (converted once), and
    the conversion's seconds (0 when it was already there)."""
    from bench.make_checkpoint import model_for

    fp16, _ = model_for(shape, models)
    out = models / f"llama-{shape}-exl3-{bits}bpw"
    return out, convert_exl3(fp16, out, bits, devices)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="8b")
    parser.add_argument("--bits", type=float, default=4.0)
    parser.add_argument("--devices", default="0", help="GPU indices, e.g. 0,1,2,3")
    parser.add_argument("--models", type=Path, default=Path("/tmp/exlq-models"))
    args = parser.parse_args(argv)
    out, seconds = exl3_checkpoint(args.models, args.shape, args.bits, args.devices)
    print(f"{out}: converted in {seconds:.0f} s", flush=True)


if __name__ == "__main__":
    main()
