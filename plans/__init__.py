"""The files mmplan reads and writes: profile.json and plan.json, their dataclasses and schemas."""
