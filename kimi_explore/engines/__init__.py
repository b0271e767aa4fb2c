"""Compare another K3 engine with kimi_explore, site by site: `compare`, `Comparison`, the dump format,
llama.cpp's name map, routed-expert ids from vLLM / SGLang."""
