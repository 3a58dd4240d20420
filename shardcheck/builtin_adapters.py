"""The adapters shipped with shardcheck, by name: where each one's class is (`module:attr`).

The one list of them: the registry (shardcheck/conformance/adapters/__init__.py, `load`, `--impl all`)
finds them here, and the entry point (shardcheck/pytest_plugin.py) names them in `--shardcheck-impl`'s
help. Data alone, importing nothing: the entry point reads it in every pytest session of the
environment, and a session that does not use shardcheck pays for nothing more.
"""

BUILTIN = {
    "reference": "shardcheck.conformance.adapters.reference:ReferenceAdapter",
    "torch-fsdp2": "shardcheck.conformance.adapters.torch_fsdp2:TorchFSDP2Adapter",
    "torch-fsdp1": "shardcheck.conformance.adapters.torch_fsdp1:TorchFSDP1Adapter",
    "ddp": "shardcheck.conformance.adapters.ddp:DDPAdapter",
    "torch-zero": "shardcheck.conformance.adapters.torch_zero:TorchZeroAdapter",
    "deepspeed": "shardcheck.conformance.adapters.deepspeed:DeepSpeedAdapter",
    "torchtitan-simplefsdp": "shardcheck.conformance.adapters.torchtitan_simplefsdp:SimpleFSDPAdapter",
    "megatron-fsdp": "shardcheck.conformance.adapters.megatron_fsdp:MegatronFSDPAdapter",
    "accelerate": "shardcheck.conformance.adapters.accelerate:AccelerateAdapter",
    "lightning": "shardcheck.conformance.adapters.lightning:LightningAdapter",
}
