"""Random-call fuzzers (importable; ``make fuzz`` runs many seeds)."""
