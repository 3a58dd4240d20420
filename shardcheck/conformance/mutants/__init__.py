"""Mutants: deliberately broken variants of reference_impl, to show the checks can fail.

Each mutant is an adapter (``--impl shardcheck.conformance.mutants:<Class>``): the reference adapter with one
bug patched into ``reference_impl`` in every process it reaches (see ``base.py``). Patches are
process-global and never undone, so run each mutant in its own pytest process;
``tests/conformance/test_mutants.py`` does, over the check functions listed here, and asserts that
every mutant is killed (some cell FAILS) while the unmutated reference passes the same cells.

Catalogue (checks: the check functions that must each kill it, under shardcheck/conformance/checks/; every
listed check runs and must have a FAILED cell: ``test_mutants.py`` skips a check's remaining cells
once one failed (``shardcheck/conformance/mutants/per_check.py``). Every check function under
shardcheck/conformance/checks is listed for at least one mutant, except those in ``test_mutants.UNREACHABLE``
(with the reason). A mutant with ``survivor`` set is a documented gap in the checks, run as a
strict xfail; one with ``cells`` set must fail exactly those cells of its checks at world size 2
and pass the others: the training_loop mutants, ``loop.py``; one with ``rows`` set must break
exactly those promise rows of shardcheck/conformance/measure/promises.py in every cell that killed it: the
sharding liars, ``wasteful.py``):

====================================  ==================================================================================  ==================================================================
mutant (class)                        bug class modelled                                                                  checks that must each kill it
====================================  ==================================================================================  ==================================================================
mutant-clip-local-norm                clip norm from the local shard only (no all-reduce)                                 test_clip_grad_dtensor.py::test_clip_grad_norm_1d
  (ClipLocalNorm)                                                                                                         test_train_parity.py::test_train_parity
mutant-clip-replicated-overcount      NO_SHARD/replicated gradients counted once per rank in the norm                     test_clip_grad.py::test_ddp_parity
  (ClipReplicatedOvercount)
mutant-clip-inf-summed                inf-norm all-reduced with SUM (sum of per-rank maxima) instead of MAX               test_clip_grad_dtensor.py::test_clip_grad_norm_1d
  (ClipInfSummed)
mutant-clip-unclamped                 clip coefficient not clamped to 1 (small gradients scaled up)                       test_clip_grad.py::test_below_max_norm_leaves_grads_unchanged
  (ClipUnclamped)
mutant-clip-non-root-accepted         clip_grad_norm_ on a non-root unit not rejected                                     test_clip_grad.py::test_non_root
  (ClipNonRootAccepted)
mutant-scaler-found-inf-unsynced      found_inf not all-reduced across ranks                                              test_grad_scaler.py::test_sharded_grad_scaler_found_inf
  (ScalerFoundInfUnsynced)                                                                                                test_loss_scaling.py::test_skip_backoff_growth
mutant-scaler-backoff-local           scale backed off only on the rank that saw inf                                      test_grad_scaler.py::test_sharded_grad_scaler_found_inf
  (ScalerBackoffLocal)
mutant-scaler-unscale-skips-sparse    unscale_ skips sparse gradients                                                     test_grad_scaler.py::test_scaling_unscaling_sparse
  (ScalerUnscaleSkipsSparse)
mutant-comm-hook-ignored              comm hook registered but the default collective used                                test_comm_hooks.py::test_custom_hook_called
  (CommHookIgnored)
mutant-comm-hook-reregister           second comm hook registration not rejected                                          test_comm_hooks.py::test_default_communication_hook_initialization
  (CommHookReregister)
mutant-comm-hook-non-root-accepted    comm hook registration on a non-root unit not rejected                              test_comm_hooks.py::test_registering_hook_non_root
  (CommHookNonRootAccepted)
mutant-grad-divide-twice              wrong gradient divide factor: pre-divide plus full world-size post-divide           test_comm_hooks.py::test_default_communication_hook_behavior
  (GradDivideTwice)
mutant-grad-not-averaged              wrong gradient divide factor: summed, not averaged                                  test_comm_hooks.py::test_default_communication_hook_behavior
  (GradNotAveraged)                                                                                                       test_grad_scaler.py::test_fsdp_ddp_parity_with_grad_scaler
                                                                                                                          test_grad_scaler.py::test_fsdp_ddp_parity_with_grad_scaler_ws4
                                                                                                                          test_train_parity.py::test_optimizer_parity
mutant-mp-reduce-in-param-dtype       mixed precision reduce done in param dtype, reduce_dtype ignored                    test_comm_hooks.py::test_low_precision_hook
  (ReduceInParamDtype)                                                                                                    test_mixed_precision.py::test_low_precision_compute
mutant-mp-low-precision-grads-upcast  keep_low_precision_grads ignored (grads upcast)                                     test_clip_grad.py::test_low_precision_grads
  (LowPrecisionGradsUpcast)
mutant-uneven-pad-front               off-by-pad in uneven chunking: trailing rank's rows shifted by its padding          test_clip_grad.py::test_ddp_parity
  (UnevenPadFront)
mutant-full-shard-stale-regather      FULL_SHARD backward re-gather reuses stale (pre-step) parameters                    test_clip_grad_dtensor.py::test_clip_grad_norm_1d
  (StaleRegather)
mutant-ext-hooks-ignored              all-gather extension hooks silently ignored                                         test_extensions.py::test_monkey_patch
  (ExtensionHooksIgnored)                                                                                                 test_extensions.py::test_train_parity
                                                                                                                          test_extensions.py::test_uneven_shards
                                                                                                                          test_extensions.py::test_meta_init_end_to_end
                                                                                                                          test_extensions_subclasses.py::test_subclass_train_parity
mutant-ext-instance-hooks-ignored     all-gather hooks patched onto the shard object ignored (class lookup only)          test_extensions.py::test_monkey_patch
  (ExtensionInstanceHooksIgnored)
mutant-ext-local-rows-refused         unpadded extension inputs (the rank's own rows) refused instead of padded (F55)     test_extensions.py::test_uneven_shards
  (ExtensionLocalRowsRefused)         exactly the cells [*-local_rows]
mutant-ext-size-unchecked             wrongly sized fsdp_pre_all_gather inputs not detected (silently cropped)            test_extensions.py::test_wrong_size_raises_on_every_rank
  (ExtensionSizeUnchecked)
mutant-clip-no-grads-silent           clip_grad_norm_ on a rank without gradients does not warn                           test_clip_grad.py::test_no_gradients
  (ClipNoGradsSilent)
mutant-scaler-sparse-no-coalesce      fp16 sparse gradient inf-checked before coalescing (overflow on coalescing missed)  test_grad_scaler.py::test_scaling_unscaling_sparse
  (ScalerSparseNoCoalesce)
mutant-scaler-scale-not-nested        scale() does not recurse into nested iterables                                      test_grad_scaler.py::test_grad_scaling
  (ScalerScaleNotNested)
mutant-scaler-no-backoff              scale not backed off after an inf/NaN step                                          test_grad_scaler.py::test_inf_gradients_skip_optim_step
  (ScalerNoBackoff)                                                                                                       test_loss_scaling.py::test_skip_backoff_growth
mutant-scaler-growth-off-by-one       growth interval off by one (grows one finite step late)                             test_loss_scaling.py::test_skip_backoff_growth
  (ScalerGrowthOffByOne)
mutant-hybrid-no-replica-reduce       HYBRID_SHARD gradients reduced within the shard group only, not across replicas     test_train_parity.py::test_train_parity_hybrid
  (HybridNoReplicaReduce)
mutant-comm-hook-root-only-checked    root registration ignores a hook already on a sub-unit                              test_comm_hooks.py::test_registering_hook_submodules
  (CommHookRootOnlyChecked)
mutant-comm-hook-non-atomic           refused root registration leaves earlier units hooked (not all-or-nothing)          test_comm_hooks.py::test_refused_registration_leaves_no_hook
  (CommHookNonAtomic)
mutant-hybrid-shard-size-squared      HYBRID_SHARD averages over sws * sws ranks: wrong on non-square meshes              test_explore.py::test_explore
  (HybridShardSizeSquared)            (the fixed matrix has one mesh, (2, 2): it misses it)
mutant-factor-replicas-averaged       HYBRID_SHARD divide factor over the shard group only, replicas still averaged       test_train_parity_divide.py::test_train_parity_divide_factor_hybrid
  (FactorReplicasAveraged)            (pytorch#155903's class); exactly the cells [*-2x2-*], [*-4x1-*]
mutant-factor-after-predivide         divide factor applied after the default pre-divide: sum / (predivide(W) * d)        test_train_parity_divide.py::test_train_parity_divide_factor
  (FactorAfterPredivide)
mutant-ckpt-step-reset                optimizer step count not saved (restarts at 0 after a load)                         test_checkpoint.py::test_resume
  (CheckpointStepReset)                                                                                                   test_checkpoint.py::test_resume_loss_scaling
                                                                                                                          test_checkpoint_reshard.py::test_reshard
mutant-ckpt-scaler-not-restored       loss scale and growth tracker not restored on load                                  test_checkpoint.py::test_resume_loss_scaling
  (CheckpointScalerNotRestored)
mutant-ckpt-optim-state-not-resharded optimizer state not resharded (own rank's file) at another world size               test_checkpoint_reshard.py::test_reshard
  (CheckpointOptimStateNotResharded)
mutant-ckpt-export-local-shard        full_state_dict returns the local shards                                            test_checkpoint.py::test_consolidated_export
  (CheckpointExportLocalShard)
mutant-ckpt-load-unchecked            load does not validate files and shapes (errors name nothing)                       test_checkpoint.py::test_bad_input
  (CheckpointLoadUnchecked)
mutant-ckpt-digest-unchecked          load checks file sizes, not digests; exactly the cells [*-flipped]                  test_checkpoint.py::test_bad_input
  (CheckpointDigestUnchecked)
mutant-ckpt-index-error-unnamed       a corrupt index raises the parser's error; exactly the cells [*-truncated_index]    test_checkpoint.py::test_bad_input
  (CheckpointIndexErrorUnnamed)
mutant-ckpt-load-writes-cwd           load leaves a staging file in the working directory                                 test_checkpoint.py::test_bad_input
  (CheckpointLoadWritesWorkingDir)
mutant-ckpt-hybrid-replica-fresh      HYBRID_SHARD: optimizer state restored on the first replica only                   test_checkpoint.py::test_resume_hybrid
  (CheckpointHybridReplicaNotRestored)
mutant-replicates-declares-full-shard replicates every parameter while declaring FULL_SHARD (SHARD_GRAD_OP, HYBRID_SHARD)  test_sharding.py::test_sharding
  (ReplicatesDeclaresFullShard)
                                                                                                                          test_sharding.py::test_sharding_hybrid
mutant-no-reshard-after-forward       FULL_SHARD never reshards after forward (gathered parameters kept until backward)   test_sharding.py::test_sharding
  (NoReshardAfterForward)
                                                                                                                          test_sharding.py::test_sharding_hybrid
mutant-unsharded-optimizer-state      optimizer state kept at full size on every rank (parameters and gradients sharded)  test_sharding.py::test_sharding
  (UnshardedOptimizerState)
                                                                                                                          test_sharding.py::test_sharding_hybrid
mutant-gather-all-at-forward-start    FULL_SHARD gathers every unit at once when forward starts, again when backward does  test_sharding.py::test_sharding
  (GatherAllAtForwardStart)           rows: gathered during forward, gathered during backward, peak during the step
mutant-all-reduce-then-slice          gradients all-reduced whole and sliced instead of reduce-scattered                  test_sharding.py::test_sharding
  (AllReduceThenSlice)                rows: reduce_scatter bytes sent, all_reduce bytes sent
mutant-extra-parameter-copy           an unsharded copy of the parameters kept on every rank                              test_sharding.py::test_sharding
  (ExtraParameterCopy)                rows: held between steps
mutant-two-units-kept-after-forward   FULL_SHARD keeps two units gathered after forward                                   test_sharding.py::test_sharding
  (TwoUnitsKeptAfterForward)          rows: kept gathered after forward, all_gather bytes sent
mutant-gather-twice-in-backward       FULL_SHARD all-gathers each unit twice in backward                                  test_sharding.py::test_sharding
  (GatherTwiceInBackward)             rows: all_gather bytes sent
mutant-full-gradient-bucket           gradients kept full-size in an engine-owned buffer until the step                   test_sharding.py::test_sharding
  (FullGradientBucket)                rows: gradients after backward, held after backward, peak during the step
mutant-whole-optimizer-state          SHARD_OPTIMIZER declared, optimizer state kept whole on every rank (plain DDP + Adam)  test_sharding.py::test_sharding
  (WholeOptimizerState)               exactly the cells [*-SHARD_OPTIMIZER] (4 ranks); rows: held between
                                      steps, optimizer state, all_gather or broadcast bytes sent
mutant-accumulation-overwrite         accumulated gradient overwritten by each micro-batch's (grad = g, not grad += g)    test_training_loop.py::test_training_loop
  (AccumulationOverwrite)             exactly the cells [*-accumulate-*]                                                  test_training_loop.py::test_training_loop_mixed_precision
                                      and [*-every] of test_cpu_offload                                                   test_composition.py::test_cpu_offload
mutant-mp-detached-input-cast         unit inputs cast to the compute dtype outside autograd (their gradient lost)        test_training_loop.py::test_training_loop_mixed_precision
  (DetachedInputCast)                 exactly: every shape but frozen, and every low-precision-gradient cell              test_training_loop.py::test_low_precision_grads_norm
mutant-mp-reduce-lost-after-eval      reduce dtype lost after a no-grad first forward (gradients reduced in param dtype)  test_training_loop.py::test_training_loop_mixed_precision
  (ReduceDtypeLostAfterEval)          exactly the cells [*-eval_between-*]
mutant-no-sync-held-in-param-dtype    gradients held across no_sync micro-batches summed in param_dtype (F40's bug)       test_training_loop.py::test_training_loop_mixed_precision
  (UnsyncedHeldInParamDtype)          exactly the cells [*-accumulate_no_sync-*]
mutant-mp-reduce-from-trainable       reduce dtype resolved at the first forward from trainable parameters (pt#186998)    test_training_loop.py::test_requires_grad_changes
  (ReduceDtypeFromTrainable)          exactly the cells [*-unfreeze*-bf16] and [*-unfreeze*-fp16]
mutant-clip-norm-in-grad-dtype        clip norm accumulated and reduced in the gradient dtype (bfloat16), not float32     test_training_loop.py::test_low_precision_grads_norm
  (NormInGradDtype)
mutant-no-sync-held-dropped           gradients held under no_sync dropped on the last micro-batch's reduction            test_training_loop.py::test_training_loop
  (UnsyncedDroppedOnLast)             exactly the cells [*-accumulate_no_sync-*]                                          test_training_loop.py::test_training_loop_mixed_precision
mutant-ac-recompute-regathers         a recomputed forward re-gathers a unit that is still gathered (SHARD_GRAD_OP +      test_composition.py::test_activation_checkpointing
  (RecomputeRegathers)                checkpointing); exactly the cells [*-SHARD_GRAD_OP-*]
mutant-ac-saves-past-checkpointing    a unit's saved-tensors hooks override checkpointing's; exactly [*-FULL_SHARD-*]     test_composition.py::test_activation_checkpointing
  (SavesPastCheckpointing)
mutant-recompute-skips-regather       a recompute that bypasses the unit's hooks (transformers 5 checkpoints forward,     test_models_composed.py::test_model_activation_checkpointing
  (RecomputeSkipsRegather)            not __call__) reads the shards; exactly [*-transformers] (needs transformers)
mutant-root-left-replicated           the root's own parameters (embedding, output projection) replicated, only the       test_models_composed.py::test_model_sharding
  (RootLeftReplicated)                units sharded (needs transformers: llama's root is a third of it)
mutant-meta-init-unties               a weight two modules share, untied when the model is built on meta                  test_composition.py::test_meta_init
  (MetaInitUnties)                                                                                                        test_composition.py::test_meta_init_hybrid
mutant-wrapping-unties                a weight two modules share (tied embeddings), untied when the model is wrapped      test_models.py::test_model_parity
  (WrappingUnties)                    (its runs judge mutants.models.tied_tower, as the user's own model)
mutant-low-load-upcast                master weights upcast to float32 where the engine promises them as loaded (bf16)    test_models.py::test_bf16_loaded_model
  (LowLoadUpcast)                     (needs transformers, the extra models: its run skips without it)
mutant-meta-load-drops-buffers        a model loaded from rank 0 into meta skeletons without its non-persistent buffers   test_models_loaded.py::test_meta_load
  (MetaLoadDropsBuffers)              (rotary inv_freq); exactly [*llama*], [*mixtral*] (needs transformers)
mutant-resume-loses-buffers           non-persistent buffers (rotary inv_freq) left zeroed by a checkpoint's load         test_models_loaded.py::test_resume
  (ResumeLosesBuffers)                exactly [*llama*], [*mixtral*] (needs transformers)
mutant-export-drops-tied              the exported full state dict drops a tied weight's key (lm_head.weight)             test_models_loaded.py::test_export_from_pretrained
  (ExportDropsTied)                   exactly [*gpt2*], [*llama-tied*] (needs transformers)
mutant-meta-init-buffer-uninitialized a non-persistent buffer left as to_empty() left it (its module owns no parameter)   test_composition.py::test_meta_init
  (BufferLeftUninitialized)
mutant-buffers-not-broadcast          buffers not broadcast from rank 0 before forward (statistics diverge per rank)      test_composition.py::test_buffers
  (BuffersNotBroadcast)
mutant-compile-dropped                a layer's torch.compile silently dropped when it is sharded (eager fallback)        test_composition.py::test_compile
  (CompileDropped)
mutant-compile-fragments-only         a compiled layer runs eagerly but for the weightless helpers it calls (F51's shape  test_models_composed.py::test_model_compile
  (CompileFragmentsOnly)              on a real layer); exactly every cell (needs transformers)
mutant-tp-norm-counts-replicas        TP-replicated gradients counted once per TP rank in the norm                        test_composition.py::test_tensor_parallel
  (TPNormPerRank)                     exactly the cells [*-norm2] (world size 4)
mutant-tp-input-grad-not-reduced      a column-parallel input's gradient not all-reduced over the TP group                test_composition.py::test_tensor_parallel
  (TPInputGradNotReduced)
mutant-mp-cast-detaches-on-change     a grad-requiring input cast outside autograd when its dtype changes (pt#90921)      test_mixed_precision.py::test_per_unit_policies
  (CastDetachesOnDtypeChange)         exactly the per-unit cells [*] and [*-own_dtype]                                    test_mixed_precision.py::test_buffer_dtype
mutant-mp-buffer-dtype-ignored        MixedPrecision.buffer_dtype ignored: buffers keep their dtype (pytorch#143900)      test_mixed_precision.py::test_buffer_dtype
  (BufferDtypeIgnored)                exactly the cells [*-buffer_dtype]
mutant-mp-buffers-follow-param-dtype  buffers cast to param_dtype when the policy sets no buffer_dtype                    test_mixed_precision.py::test_buffer_dtype
  (BuffersFollowParamDtype)           exactly the cells [*-own_dtype]
mutant-scaler-refuses-fp16-grads      unscale_ refuses float16 gradients (fairscale#834); exactly the float16 cells       test_grad_scaler_low_grads.py::test_low_precision_grads_through_the_scaler
  (ScalerRefusesFp16Grads)            (the seed's sparse gradients are float16 too)                                       test_grad_scaler.py::test_scaling_unscaling_sparse
mutant-scaler-inf-skips-low-grads     inf check skips gradients kept below their parameter's precision                    test_grad_scaler_low_grads.py::test_low_precision_grads_through_the_scaler
  (ScalerInfCheckSkipsLowPrecision)   exactly the cells [*-inf_on_one_rank]
mutant-token-mean-per-micro-batch     token-weighted loss normalized per micro-batch (the micro-batch means averaged:     test_training_loop_knobs.py::test_token_weighted_loss
  (TokenMeanPerMicroBatch)            transformers' Trainer before 4.46); exactly every cell
mutant-token-count-local              token count of the rank's own micro-batches, not all-reduced (each rank's mean      test_training_loop_knobs.py::test_token_weighted_loss
  (TokenCountLocal)                   averaged: transformers 4.46); exactly every cell
mutant-reshard-flag-ignored           reshard_after_backward=False ignored: parameters gathered again every micro-batch   test_training_loop_knobs.py::test_accumulation_flags
  (ReshardFlagIgnored)                exactly the cells [*-reshard_after_backward], [*-torch_pattern]
mutant-kept-past-last-backward        parameters kept unsharded past a step's last backward (pre-step values computed     test_training_loop_knobs.py::test_accumulation_flags
  (KeptPastLastBackward)              with); exactly the cells [*-reshard_after_backward], [*-torch_pattern]
mutant-no-sync-reduces-twice          gradients reduced under no_sync and again, held, on the last micro-batch; exactly   test_training_loop_knobs.py::test_accumulation_flags
  (NoSyncReducesTwice)                the cells [*-reshard_after_backward], [*-torch_pattern]
mutant-last-backward-defers-reduction set_is_last_backward(False) taken as no gradient sync (reductions deferred to       test_training_loop_knobs.py::test_accumulation_flags
  (LastBackwardDefersReduction)       the backward marked last); exactly the cells [*-last_backward]
mutant-idle-expert-grad-dropped       an expert idle on a rank keeps a None gradient there, the other ranks' reduced      test_training_loop_knobs_experts.py::test_idle_experts
  (IdleExpertGradDropped)             contribution dropped; exactly the cells [*-idle_on_a_rank]
mutant-idle-expert-zero-grad          an expert idle on every rank given a zero gradient (AdamW decays and steps it);     test_training_loop_knobs_experts.py::test_idle_experts
  (IdleExpertZeroGrad)                exactly the cells [*-idle_everywhere]
mutant-idle-expert-mean-over-users    an expert's gradient divided by the number of ranks that used it, not the world     test_training_loop_knobs_experts.py::test_idle_experts
  (IdleExpertMeanOverUsers)           size; exactly the cells [*-idle_on_a_rank]
mutant-expert-mesh-unreplicated       experts sharded over their sub-mesh's shard dimension alone (gradients never      test_training_loop_knobs_experts.py::test_experts_on_their_own_mesh
  (ExpertMeshUnreplicated)            reduced across its other dimension); exactly every cell
====================================  ==================================================================================  ==================================================================
"""

from shardcheck.conformance.mutants.base import MutantAdapter, applied
from shardcheck.conformance.mutants.checkpoint import (
    CheckpointDigestUnchecked, CheckpointExportLocalShard, CheckpointHybridReplicaNotRestored, CheckpointIndexErrorUnnamed,
    CheckpointLoadUnchecked, CheckpointLoadWritesWorkingDir, CheckpointOptimStateNotResharded, CheckpointScalerNotRestored,
    CheckpointStepReset,
)
from shardcheck.conformance.mutants.clip import (
    ClipInfSummed,
    ClipLocalNorm,
    ClipNoGradsSilent,
    ClipNonRootAccepted,
    ClipReplicatedOvercount,
    ClipUnclamped,
)
from shardcheck.conformance.mutants.models import (
    ExportDropsTied,
    LowLoadUpcast,
    MetaLoadDropsBuffers,
    ResumeLosesBuffers,
    WrappingUnties,
)
from shardcheck.conformance.mutants.composition import (
    BufferLeftUninitialized,
    BuffersNotBroadcast,
    CompileDropped,
    CompileFragmentsOnly,
    MetaInitUnties,
    TPInputGradNotReduced,
    TPNormPerRank,
    RecomputeRegathers,
    RecomputeSkipsRegather,
    SavesPastCheckpointing,
)
from shardcheck.conformance.mutants.comm import (
    CommHookIgnored,
    CommHookNonAtomic,
    CommHookNonRootAccepted,
    CommHookReregister,
    CommHookRootOnlyChecked,
)
from shardcheck.conformance.mutants.wasteful import (
    AllReduceThenSlice,
    ExtraParameterCopy,
    FullGradientBucket,
    GatherAllAtForwardStart,
    GatherTwiceInBackward,
    NoReshardAfterForward,
    ReplicatesDeclaresFullShard,
    RootLeftReplicated,
    TwoUnitsKeptAfterForward,
    UnshardedOptimizerState,
    WholeOptimizerState,
)
from shardcheck.conformance.mutants.extensions import (
    ExtensionHooksIgnored,
    ExtensionInstanceHooksIgnored,
    ExtensionLocalRowsRefused,
    ExtensionSizeUnchecked,
)
from shardcheck.conformance.mutants.knobs import (
    ExpertMeshUnreplicated, IdleExpertGradDropped, IdleExpertMeanOverUsers, IdleExpertZeroGrad, KeptPastLastBackward,
    LastBackwardDefersReduction, NoSyncReducesTwice, ReshardFlagIgnored, TokenCountLocal, TokenMeanPerMicroBatch,
)
from shardcheck.conformance.mutants.loop import (
    AccumulationOverwrite,
    DetachedInputCast,
    NormInGradDtype,
    ReduceDtypeFromTrainable,
    ReduceDtypeLostAfterEval,
    UnsyncedDroppedOnLast,
    UnsyncedHeldInParamDtype,
)
from shardcheck.conformance.mutants.precision import (
    BufferDtypeIgnored,
    BuffersFollowParamDtype,
    CastDetachesOnDtypeChange,
)
from shardcheck.conformance.mutants.scaler import (
    ScalerBackoffLocal,
    ScalerFoundInfUnsynced,
    ScalerInfCheckSkipsLowPrecision,
    ScalerGrowthOffByOne,
    ScalerNoBackoff,
    ScalerRefusesFp16Grads,
    ScalerScaleNotNested,
    ScalerSparseNoCoalesce,
    ScalerUnscaleSkipsSparse,
)
from shardcheck.conformance.mutants.divide import FactorAfterPredivide, FactorReplicasAveraged
from shardcheck.conformance.mutants.sharding import (
    GradDivideTwice,
    GradNotAveraged,
    HybridShardSizeSquared,
    HybridNoReplicaReduce,
    LowPrecisionGradsUpcast,
    ReduceInParamDtype,
    StaleRegather,
    UnevenPadFront,
)

MUTANTS: tuple[type[MutantAdapter], ...] = (
    ClipLocalNorm,
    ClipReplicatedOvercount,
    ClipInfSummed,
    ClipUnclamped,
    ClipNonRootAccepted,
    ScalerFoundInfUnsynced,
    ScalerBackoffLocal,
    ScalerUnscaleSkipsSparse,
    CommHookIgnored,
    CommHookReregister,
    CommHookNonRootAccepted,
    GradDivideTwice,
    GradNotAveraged,
    ReduceInParamDtype,
    LowPrecisionGradsUpcast,
    UnevenPadFront,
    StaleRegather,
    ExtensionHooksIgnored,
    ExtensionInstanceHooksIgnored,
    ExtensionSizeUnchecked,
    ClipNoGradsSilent,
    ScalerSparseNoCoalesce,
    ScalerScaleNotNested,
    ScalerNoBackoff,
    ScalerGrowthOffByOne,
    HybridNoReplicaReduce,
    CommHookRootOnlyChecked,
    CommHookNonAtomic,
    HybridShardSizeSquared,
    FactorReplicasAveraged,
    FactorAfterPredivide,
    CheckpointStepReset,
    CheckpointScalerNotRestored,
    CheckpointOptimStateNotResharded,
    CheckpointExportLocalShard,
    CheckpointLoadUnchecked,
    CheckpointDigestUnchecked,
    CheckpointIndexErrorUnnamed,
    CheckpointLoadWritesWorkingDir,
    CheckpointHybridReplicaNotRestored,
    ReplicatesDeclaresFullShard,
    NoReshardAfterForward,
    UnshardedOptimizerState,
    GatherAllAtForwardStart,
    AllReduceThenSlice,
    ExtraParameterCopy,
    TwoUnitsKeptAfterForward,
    GatherTwiceInBackward,
    FullGradientBucket,
    WholeOptimizerState,
    AccumulationOverwrite,
    DetachedInputCast,
    ReduceDtypeLostAfterEval,
    NormInGradDtype,
    UnsyncedDroppedOnLast,
    RecomputeRegathers,
    SavesPastCheckpointing,
    RecomputeSkipsRegather,
    RootLeftReplicated,
    MetaInitUnties,
    WrappingUnties,
    LowLoadUpcast,
    MetaLoadDropsBuffers,
    ResumeLosesBuffers,
    ExportDropsTied,
    BufferLeftUninitialized,
    BuffersNotBroadcast,
    CompileDropped,
    CompileFragmentsOnly,
    TPNormPerRank,
    TPInputGradNotReduced,
    CastDetachesOnDtypeChange,
    BufferDtypeIgnored,
    BuffersFollowParamDtype,
    ScalerRefusesFp16Grads,
    ScalerInfCheckSkipsLowPrecision,
    ReduceDtypeFromTrainable,
    UnsyncedHeldInParamDtype,
    ExtensionLocalRowsRefused,
    TokenMeanPerMicroBatch, TokenCountLocal, ReshardFlagIgnored, KeptPastLastBackward, NoSyncReducesTwice,
    LastBackwardDefersReduction, IdleExpertGradDropped, IdleExpertZeroGrad, IdleExpertMeanOverUsers, ExpertMeshUnreplicated,
)

__all__ = ["MUTANTS", "MutantAdapter", "applied"] + [m.__name__ for m in MUTANTS]
