"""F30: Lightning Fabric refuses `FSDPStrategy` off a GPU: `Fabric(accelerator="cpu", strategy="fsdp")`
or `strategy=FSDPStrategy()` raises "FSDP is only available on GPU" (connector.py), although torch's
FSDP1 runs on CPU/gloo with `device_id=cpu`. A clear error, not a silent fallback; past it (a subclass
of FSDPStrategy), `setup_module` passes `device_id=root_device.index`, None on CPU, which FSDP1 refuses
there. ModelParallelStrategy (FSDP2) runs on CPU as shipped."""

import os

from _launch import run, verdict


def body(rank, world_size):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import FSDPStrategy

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    seen = []
    for strategy in ("fsdp", FSDPStrategy()):
        try:
            Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
            seen.append("accepted")
        except ValueError as exc:
            seen.append(str(exc).split(".")[0])
    return "; ".join(seen)


if __name__ == "__main__":
    results = run(body, world_size=2, timeout_s=60)
    verdict(all(r.count("FSDP is only available on GPU") == 2 for r in results.values()),
            "Fabric refuses FSDPStrategy on CPU (ValueError)", results)
