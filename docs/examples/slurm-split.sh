#!/bin/bash
# shardcheck's matrix on a Slurm cluster: a job array of PARTS tasks, each running one part of the
# selection (`shardcheck run --split K/N`), then one job that joins the parts' reports
# (`shardcheck report merge`) once every task has ended. docs/splitting.md.
#
#   sbatch docs/examples/slurm-split.sh                  # from the shardcheck checkout, its venv active
#   sbatch --array=1-8 docs/examples/slurm-split.sh      # another number of parts (the array starts at 1)
#
# Every task must see the same checkout (the committed reports/*.json balance the parts: the same
# files give the same parts on every node) and the same software (the merge refuses parts that ran
# another torch or other implementations).
#SBATCH --job-name=shardcheck-part
#SBATCH --array=1-4
#SBATCH --cpus-per-task=4
#SBATCH --mem=16G
#SBATCH --time=00:30:00
#SBATCH --output=reports/split/slurm-%A_%a.out
set -euo pipefail

IMPLS=(--impl reference --impl torch-fsdp2 --impl ddp)   # what to judge: any `shardcheck run` selection
PARTS=${SLURM_ARRAY_TASK_COUNT}                           # the array's size: N of K/N
OUT=reports/split/${SLURM_ARRAY_JOB_ID}
mkdir -p "$OUT"

if [ "${SLURM_ARRAY_TASK_ID}" = "${SLURM_ARRAY_TASK_MIN}" ]; then
    # The merge, submitted once, starts when every task of the array has ended (afterany: also
    # when a part had failed cells, whose report is whole; a part that wrote no report is named
    # by the merge as missing, in one line, exit 7).
    sbatch --dependency="afterany:${SLURM_ARRAY_JOB_ID}" --job-name=shardcheck-merge \
        --cpus-per-task=1 --time=00:05:00 --output="$OUT/merge.out" \
        --wrap="shardcheck report merge $OUT/part-*.json -o $OUT/merged.json && \
                shardcheck matrix $OUT/merged.json --markdown $OUT/MATRIX.md"
fi

# Part K of N; the cells stream to part-K.jsonl as they finish (a task killed at its time limit
# leaves them: `shardcheck report assemble $OUT/part-K.jsonl` makes its report, complete: false).
exec shardcheck run "${IMPLS[@]}" --split "${SLURM_ARRAY_TASK_ID}/${PARTS}" \
    --workers "${SLURM_CPUS_PER_TASK}" -o "$OUT/part-${SLURM_ARRAY_TASK_ID}.json"
