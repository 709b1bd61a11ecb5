"""Cost model: hardware specs, compute, communication, memory and pipeline simulation."""
