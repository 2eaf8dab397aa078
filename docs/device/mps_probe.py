"""Does CUDA MPS keep a host-synchronising scorer at its pace beside training processes on one GPU?

The quality study (docs/quality.md) runs up to ten worker processes on one H200: fine-tunes beside lm-eval scorers.
lm-eval scores a request with a few small kernels and two host reads, so without MPS every read waits for the GPU's
time slices among the processes (40 requests/s beside six trainers against 150-350 without them). This probe
measures that directly, without the study: a scorer (a [64, 128, 8192] log-softmax per "batch", then 64 small
gather-and-read "requests") alone and beside K trainer processes (fp32 matmuls with TF32, the study's fine-tune
precision), first as the machine is, then under the MPS control daemon when `nvidia-cuda-mps-control` exists.

    python docs/device/mps_probe.py [K ...]      # default K = 0 3 6; prints one line per (MPS, K)
"""

import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import time

SECONDS = 12.0


def trainer(stop) -> None:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = True
    a = torch.randn(4096, 4096, device="cuda", requires_grad=True)
    b = torch.randn(4096, 4096, device="cuda")
    while not stop.is_set():
        for _ in range(20):
            (a @ b).sum().backward()
        torch.cuda.synchronize()


def scorer(seconds: float, queue) -> None:
    import torch

    logits = torch.randn(64, 128, 8192, device="cuda")
    index = torch.randint(0, 8192, (64, 8, 1), device="cuda")
    torch.cuda.synchronize()
    requests, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        logp = torch.log_softmax(logits, dim=-1)
        for i in range(64):
            part = logp[i, -8:].unsqueeze(0)
            float(torch.gather(part, 2, index[i : i + 1]).sum())
            bool((part.argmax(-1) == index[i : i + 1, :, 0]).all())
            requests += 1
    queue.put(requests / (time.perf_counter() - start))


def measure(trainers: int) -> float:
    ctx = mp.get_context("spawn")
    stop, queue = ctx.Event(), ctx.Queue()
    workers = [ctx.Process(target=trainer, args=(stop,)) for _ in range(trainers)]
    for w in workers:
        w.start()
    time.sleep(8.0 if trainers else 0.0)  # the trainers' CUDA start-up
    probe = ctx.Process(target=scorer, args=(SECONDS, queue))
    probe.start()
    rate = queue.get(timeout=120)
    probe.join()
    stop.set()
    for w in workers:
        w.join(timeout=30)
    return rate


def main() -> None:
    counts = [int(k) for k in sys.argv[1:]] or [0, 3, 6]
    for k in counts:
        print(f"no MPS, {k} trainers: scorer {measure(k):.0f} requests/s", flush=True)
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        print("MPS: nvidia-cuda-mps-control is not on this machine", flush=True)
        return
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": "/tmp/mps_pipe", "CUDA_MPS_LOG_DIRECTORY": "/tmp/mps_log"}
    for d in ("/tmp/mps_pipe", "/tmp/mps_log"):
        os.makedirs(d, exist_ok=True)
    started = subprocess.run([control, "-d"], env=env, capture_output=True, text=True)
    print(f"MPS daemon: exit {started.returncode} {started.stdout.strip()} {started.stderr.strip()}", flush=True)
    if started.returncode != 0:
        return
    os.environ.update(env)
    try:
        for k in counts:
            print(f"MPS, {k} trainers: scorer {measure(k):.0f} requests/s", flush=True)
    finally:
        subprocess.run([control], input="quit\n", env=env, text=True)


if __name__ == "__main__":
    main()
