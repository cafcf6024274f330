"""The drafters wing of speculation: every source of draft tokens behind one `Proposer` protocol
(lookups: n-gram, predicted outputs, grammar-forced text; model drafters: a draft model, an
EAGLE-3 head), their explicit registry, and the speculator that offers and proposes each step."""
