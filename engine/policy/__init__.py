"""The policy wing of speculation: how many drafts each decoding request verifies each step, from
a calibrated step-time model, the drafting costs, per-request acceptance estimates and the
step's goodput; the scheduler sees it only through `DraftPolicy.decide`."""
