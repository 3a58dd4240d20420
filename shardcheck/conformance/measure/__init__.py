"""What a rank holds and sends while an engine trains, measured by the suite, never taken from the
adapter's word: storage bytes by kind and their peak (`memory.MemoryTracker`), collectives by kind,
volume, dtype and group (`traffic.CollectiveCounter`), both over a trainer's steps
(`footprint.measure`), and what each sharding strategy promises of them (`promises`)."""
