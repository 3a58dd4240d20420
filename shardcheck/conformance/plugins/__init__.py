"""pytest plumbing of the conformance suite: which implementations run, what each cell requires,
and the expectation manifests turned into strict xfails."""
