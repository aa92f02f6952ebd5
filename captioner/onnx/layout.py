"""What `captioner export --format onnx` writes, named once: the folder's files, each graph's inputs and outputs, the
search graphs' state and the layout's number. The exporter (`captioner.onnx_export`) and both runtimes
(`captioner.onnx`, and deploy/'s `captioner_onnx`) read these names from here, and a host in another language
(JavaScript in a browser) translates this file. Plain Python: importing it imports neither torch nor ONNX Runtime."""

FORMAT = 2  # the layout of captioner.json and the graphs (1: a step graph, searched in numpy; refused)
CONFIG = "captioner.json"  # the vocabulary, the input, the grid and the search's defaults; written last, it marks
# the folder complete
GRAPHS = ("encoder", "start", "greedy", "beam")  # each as <name>.onnx
WEIGHTS = "weights.bin"  # the weights that more than one graph holds, written once (ONNX external data)
STATE = ("tokens", "h", "c", "scores", "lengths", "finished")  # a word graph's state: inputs, and outputs + "_out"
INPUTS = {
    "encoder": ["images"],
    "start": ["annotations"],
    "greedy": [*STATE, "annotations", "keys"],
    "beam": [*STATE, "annotations", "keys", "length_penalty"],
}
OUTPUTS = {
    "encoder": ["annotations"],
    "start": ["h", "c", "keys"],
    "greedy": [*(name + "_out" for name in STATE), "words", "alphas", "word_scores", "word_lengths"],
    "beam": [*(name + "_out" for name in STATE), "parents", "words", "alphas", "winner", "winner_score",
             "winner_length"],
}  # fmt: skip
