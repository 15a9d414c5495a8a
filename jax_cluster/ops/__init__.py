"""One module per op family: primitive, abstract eval, lowering, batching."""
