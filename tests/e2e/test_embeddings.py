"""/v1/embeddings and /pooling end to end: the real `openai` SDK (and raw HTTP) over a socket,
against a server on the default model (a decoder that also chats) and one on a tiny random
BERT in a sentence-transformers directory; references are transformers' final-norm hidden
states and sentence-transformers' encode on the same weights."""

import base64
import json
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F

from .server import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
KEY = "embeddings-test-key"
TEXTS = ["The capital of France is Paris.", "Continuous batching", "a"]


def post(url: str, path: str, body: dict, key: str | None = KEY, method: str = "POST"):
    """(status, JSON body) of a raw request."""
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url + path, json.dumps(body).encode() if body is not None
                                     else None, headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture(scope="module")
def server(default_model_dir):
    srv = ServerProcess("--served-model-name", MODEL, "--api-key", KEY, "--max-model-len", "512",
                        "--enable-debug-endpoints")
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def reference(default_model_dir):
    """text -> transformers' final-norm hidden state of its last token, L2-normalised (vLLM's
    pooling of a causal LM), tokenized as the server does."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(default_model_dir))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32)

    def embed(text: str) -> torch.Tensor:
        ids = tokenizer(text, return_tensors="pt").input_ids
        with torch.no_grad():
            hidden = model(ids, output_hidden_states=True).hidden_states[-1][0, -1]
        return F.normalize(hidden, dim=-1)
    return embed


def vectors(response) -> torch.Tensor:
    return torch.tensor([d.embedding for d in response.data])


def test_decoder_embeddings_equal_transformers(client, reference):
    out = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert out.object == "list" and out.model == MODEL and len(out.data) == 3
    assert [d.index for d in out.data] == [0, 1, 2] and all(d.object == "embedding" for d in out.data)
    got = vectors(out)
    for text, row in zip(TEXTS, got):
        assert F.cosine_similarity(row, reference(text), dim=0) > 1 - 1e-4
        assert abs(row.norm().item() - 1) < 1e-5
    assert out.usage.prompt_tokens == out.usage.total_tokens > 0


def test_base64_equals_float_and_a_batch_equals_its_items(client, server):
    floats = vectors(client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float"))
    # the SDK asks for base64 when no format is given, and decodes it
    decoded = vectors(client.embeddings.create(model=MODEL, input=TEXTS))
    torch.testing.assert_close(decoded, floats, atol=0, rtol=0)
    status, raw = post(server.url, "/v1/embeddings", {"input": TEXTS[0], "encoding_format": "base64"})
    assert status == 200
    little = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    torch.testing.assert_close(torch.from_numpy(little.copy()), floats[0], atol=0, rtol=0)
    for text, row in zip(TEXTS, floats):
        alone = vectors(client.embeddings.create(model=MODEL, input=text, encoding_format="float"))[0]
        torch.testing.assert_close(alone, row, atol=1e-5, rtol=0)


def test_vllms_binary_encodings(server, client):
    """embed_dtype and endianness of base64, and vLLM's bytes / bytes_only answers: the vectors'
    bytes back to back, with a metadata header (bytes) saying where each one lies."""
    want = vectors(client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")).numpy()
    body = json.dumps({"input": TEXTS, "encoding_format": "bytes", "embed_dtype": "float16",
                       "endianness": "big"}).encode()
    request = urllib.request.Request(server.url + "/v1/embeddings", body, {
        "content-type": "application/json", "authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=60) as r:
        content_type, metadata, raw = r.headers["content-type"], json.loads(r.headers["metadata"]), r.read()
    assert content_type == "application/octet-stream" and metadata["model"] == MODEL
    assert [item["index"] for item in metadata["data"]] == [0, 1, 2] and metadata["usage"]["prompt_tokens"] > 0
    for item, row in zip(metadata["data"], want):
        assert (item["embed_dtype"], item["endianness"], item["shape"]) == ("float16", "big", [576])
        got = np.frombuffer(raw[item["start"]:item["end"]], ">f2")
        assert np.array_equal(got, row.astype(">f2"))
    status, encoded = post(server.url, "/v1/embeddings", {"input": TEXTS[0], "encoding_format": "base64",
                                                          "embed_dtype": "bfloat16"})
    bf16 = torch.frombuffer(bytearray(base64.b64decode(encoded["data"][0]["embedding"])), dtype=torch.bfloat16)
    assert torch.equal(bf16, torch.from_numpy(want[0]).bfloat16())
    body = json.dumps({"input": TEXTS[:1], "encoding_format": "bytes_only", "embed_dtype": "fp8_e4m3",
                       "task": "embed"}).encode()
    request = urllib.request.Request(server.url + "/pooling", body, {
        "content-type": "application/json", "authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=60) as r:
        assert r.headers["metadata"] is None and len(r.read()) == 576  # one byte a value


def test_token_id_inputs_and_usage(server, client):
    tokenizer_ids = post(server.url, "/tokenize", {"prompt": TEXTS[0]})[1]["tokens"]
    by_text = vectors(client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float"))
    by_ids = client.embeddings.create(model=MODEL, input=tokenizer_ids, encoding_format="float")
    torch.testing.assert_close(vectors(by_ids)[0], by_text[0], atol=1e-6, rtol=0)
    assert by_ids.usage.prompt_tokens == len(tokenizer_ids)
    two = client.embeddings.create(model=MODEL, input=[tokenizer_ids, tokenizer_ids[:3]],
                                   encoding_format="float", user="someone")
    assert len(two.data) == 2 and two.usage.prompt_tokens == len(tokenizer_ids) + 3


def test_one_server_chats_and_embeds(client):
    chat = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert chat.choices[0].message.content
    models = client.models.list().data
    assert models[0].supported_tasks == ["generate", "embed", "token_embed"]


def test_the_chat_form_embeds_the_rendered_conversation(server, client):
    messages = [{"role": "user", "content": "Hello there"}]
    status, out = post(server.url, "/v1/embeddings", {"messages": messages})
    assert status == 200 and len(out["data"]) == 1
    rendered = post(server.url, "/tokenize", {"messages": messages,
                                             "add_generation_prompt": False})[1]["tokens"]
    direct = vectors(client.embeddings.create(model=MODEL, input=rendered, encoding_format="float"))[0]
    torch.testing.assert_close(torch.tensor(out["data"][0]["embedding"]), direct, atol=1e-6, rtol=0)
    # vLLM's other chat forms: the conversation as input, and a batch of conversations
    other = [{"role": "user", "content": "Goodbye"}]
    as_input = post(server.url, "/v1/embeddings", {"input": messages})[1]
    batch = post(server.url, "/v1/embeddings", {"messages": [messages, other]})[1]
    alone = post(server.url, "/v1/embeddings", {"input": [other]})[1]
    assert [d["index"] for d in batch["data"]] == [0, 1]
    for got, want in ((as_input["data"][0], out["data"][0]), (batch["data"][0], out["data"][0]),
                      (batch["data"][1], alone["data"][0])):
        torch.testing.assert_close(torch.tensor(got["embedding"]), torch.tensor(want["embedding"]),
                                   atol=1e-6, rtol=0)


def test_pooling_returns_every_tokens_hidden_state(server, client):
    ids = post(server.url, "/tokenize", {"prompt": TEXTS[1]})[1]["tokens"]
    status, out = post(server.url, "/pooling", {"input": TEXTS[1], "task": "token_embed"})
    assert status == 200 and out["data"][0]["object"] == "pooling"
    per_token = torch.tensor(out["data"][0]["data"])
    assert per_token.shape == (len(ids), 576)
    embedding = vectors(client.embeddings.create(model=MODEL, input=TEXTS[1], encoding_format="float"))[0]
    torch.testing.assert_close(per_token[-1], embedding, atol=1e-5, rtol=0)
    # the default task is the model's pooling task, embed (current vLLM's reading)
    for body in ({"input": TEXTS[1], "task": "embed"}, {"input": TEXTS[1]}):
        status, pooled = post(server.url, "/pooling", body)
        torch.testing.assert_close(torch.tensor(pooled["data"][0]["data"]), embedding, atol=1e-5, rtol=0)
    status, out = post(server.url, "/pooling", {"input": TEXTS[1], "dimensions": 8})
    assert status == 400 and out["error"]["param"] == "dimensions"


def test_score_and_rerank_are_cosines_of_the_embeddings(server, client):
    query, docs = "Where is Paris?", TEXTS
    embedded = vectors(client.embeddings.create(model=MODEL, input=[query, *docs], encoding_format="float"))
    cosines = [float(embedded[0] @ embedded[1 + i]) for i in range(len(docs))]
    status, out = post(server.url, "/rerank", {"model": MODEL, "query": query,
                                               "documents": [docs[0], {"text": docs[1]}, docs[2]]})
    assert status == 200 and out["model"] == MODEL and out["usage"]["total_tokens"] > 0
    assert [r["index"] for r in out["results"]] == sorted(range(3), key=lambda i: -cosines[i])
    for r in out["results"]:
        assert abs(r["relevance_score"] - cosines[r["index"]]) < 1e-5
        assert r["document"] == {"text": docs[r["index"]]}
    for path in ("/v1/rerank", "/v2/rerank"):
        status, top = post(server.url, path, {"query": query, "documents": docs, "top_n": 1,
                                              "return_documents": False})
        assert status == 200 and [(r["index"], r["document"]) for r in top["results"]] == [
            (out["results"][0]["index"], None)]
    status, one_to_many = post(server.url, "/score", {"text_1": query, "text_2": docs})
    assert status == 200 and [d["object"] for d in one_to_many["data"]] == ["score"] * 3
    assert [abs(d["score"] - c) < 1e-5 for d, c in zip(one_to_many["data"], cosines)] == [True] * 3
    pairs = [float(embedded[1 + i] @ embedded[1 + (i + 1) % 3]) for i in range(3)]
    status, pairwise = post(server.url, "/v1/score", {"text_1": docs, "text_2": docs[1:] + docs[:1]})
    assert status == 200 and [abs(d["score"] - p) < 1e-5 for d, p in zip(pairwise["data"], pairs)] == [True] * 3
    # vLLM's other names for the pair
    for names in (("queries", "documents"), ("queries", "items"), ("data_1", "data_2")):
        status, named = post(server.url, "/score", {names[0]: query, names[1]: docs})
        assert status == 200 and [d["score"] for d in named["data"]] == pytest.approx(cosines, abs=1e-5)
    # a lone string as documents; max_tokens_per_doc keeps each document's first tokens
    status, one = post(server.url, "/rerank", {"query": query, "documents": docs[0]})
    assert status == 200 and one["results"][0]["relevance_score"] == pytest.approx(cosines[0], abs=1e-5)
    first_words = vectors(client.embeddings.create(model=MODEL, input=[query, "The capital"],
                                                   encoding_format="float"))
    status, cut = post(server.url, "/v2/rerank", {"query": query, "documents": [docs[0]],
                                                  "max_tokens_per_doc": 2})
    assert cut["results"][0]["relevance_score"] == pytest.approx(float(first_words[0] @ first_words[1]), abs=1e-5)
    for path, body, param in (("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
                              ("/score", {"text_1": "a", "text_2": []}, "text_2"),
                              ("/rerank", {"query": "", "documents": ["a"]}, "query"),
                              ("/rerank", {"query": "a", "documents": [{"txt": "b"}]}, "documents"),
                              ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
                              ("/score", {"text_1": "a", "text_2": "b", "mm_processor_kwargs": {}},
                               "mm_processor_kwargs"),
                              ("/rerank", {"query": "a", "documents": ["b"], "use_activation": False},
                               "use_activation"),
                              ("/score", {"text_1": "a"}, "text_2"),
                              ("/rerank", {"query": "a", "documents": ["b"], "instruction": "Rank."},
                               "instruction"),
                              ("/rerank", {"query": "a", "documents": ["b"], "max_tokens_per_doc": -1},
                               "max_tokens_per_doc")):
        status, err = post(server.url, path, body)
        assert status == 400 and err["error"]["param"] == param, (path, err)


def test_cohere_embed_v2_through_the_cohere_sdk(server, client):
    """/v2/embed (vLLM's Cohere route) through the cohere SDK: each embedding type is the
    /v1/embeddings vector, encoded as Cohere encodes it; the default model has no prompts, so
    Cohere's input types embed the bare text."""
    import cohere

    co = cohere.ClientV2(api_key=KEY, base_url=server.url)
    out = co.embed(model=MODEL, texts=TEXTS, input_type="search_document",
                   embedding_types=["float", "base64", "binary", "ubinary"])
    want = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    floats = np.array(out.embeddings.float_)
    assert np.array_equal(floats, vectors(want).numpy()) and out.texts == TEXTS
    assert out.meta.billed_units.input_tokens == out.meta.tokens.input_tokens == want.usage.prompt_tokens
    for row, encoded, ubinary, binary in zip(floats, out.embeddings.base64, out.embeddings.ubinary,
                                             out.embeddings.binary):
        assert np.array_equal(np.frombuffer(base64.b64decode(encoded), "<f4"), row)
        bits = np.unpackbits(np.array(ubinary, dtype=np.uint8))  # the first dimension, the high bit
        assert np.array_equal(bits, (row >= 0).astype(np.uint8)) and len(ubinary) == row.size // 8
        assert [b + 128 for b in binary] == ubinary
    # inputs: each a user turn, as /v1/embeddings' chat form renders it
    turn = co.embed(model=MODEL, inputs=[{"content": [{"type": "text", "text": TEXTS[0]}]}],
                    input_type="search_query", embedding_types=["float"])
    chat = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float", extra_body={
        "messages": [{"role": "user", "content": TEXTS[0]}], "input": None})
    assert np.allclose(turn.embeddings.float_[0], chat.data[0].embedding, atol=1e-6)
    # truncate: END (the default) keeps the first tokens, START the last, NONE none
    long = "The capital of France is Paris. " * 90  # beyond --max-model-len 512
    end = co.embed(model=MODEL, texts=[long], input_type="clustering", embedding_types=["float"])
    first = client.embeddings.create(model=MODEL, input=long, encoding_format="float",
                                     extra_body={"truncate_prompt_tokens": 512})
    # (allclose: the second of two equal prompts reads the first's cached blocks, whose
    # chunking sums in another order)
    assert np.allclose(end.embeddings.float_[0], first.data[0].embedding, atol=1e-6)
    assert end.meta.tokens.input_tokens == 512
    start = co.embed(model=MODEL, texts=[long], input_type="clustering", embedding_types=["float"],
                     truncate="START", max_tokens=100)
    last = client.embeddings.create(model=MODEL, input=long, encoding_format="float",
                                    extra_body={"truncate_prompt_tokens": 100, "truncation_side": "left"})
    assert np.allclose(start.embeddings.float_[0], last.data[0].embedding, atol=1e-6)
    for kw, param in ((dict(truncate="NONE"), "texts"),
                      (dict(truncate="NONE", max_tokens=5, texts=["word " * 20]), "max_tokens"),
                      (dict(input_type="photo"), "input_type"), (dict(output_dimension=8), "output_dimension"),
                      (dict(embedding_types=["int8"]), "embedding_types")):
        with pytest.raises(cohere.errors.BadRequestError) as info:
            co.embed(model=MODEL, **{"texts": [long], "input_type": "classification", **kw})
        assert info.value.body["error"]["param"] == param, info.value.body
    for body, param in (({"images": ["data:image/png;base64,AAAA"]}, "images"),
                        ({"texts": ["a"], "inputs": [{"content": [{"type": "text", "text": "b"}]}]}, "inputs"),
                        ({"inputs": [{"content": [{"type": "image_url", "image_url": {"url": "u"}}]}]}, "inputs"),
                        ({"texts": []}, "texts"), ({"texts": ["a"], "truncate": "MIDDLE"}, "truncate")):
        status, err = post(server.url, "/v2/embed", {"model": MODEL, **body})
        assert status == 400 and err["error"]["param"] == param, err


def test_truncate_prompt_tokens_keeps_the_first_tokens(server, client):
    """As vLLM's pooling models (and sentence-transformers) cut: the end goes; truncation_side
    "left" keeps the last tokens instead."""
    long = "The capital of France is Paris. " + "word " * 600  # beyond --max-model-len 512
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.embeddings.create(model=MODEL, input=long)
    ids = post(server.url, "/tokenize", {"prompt": long})[1]["tokens"]
    for side, kept in ((None, ids[:100]), ("right", ids[:100]), ("left", ids[-100:])):
        cut = client.embeddings.create(model=MODEL, input=long, encoding_format="float", extra_body={
            "truncate_prompt_tokens": 100, **({"truncation_side": side} if side else {})})
        want = client.embeddings.create(model=MODEL, input=[kept], encoding_format="float")
        assert cut.usage.prompt_tokens == 100
        assert np.allclose(cut.data[0].embedding, want.data[0].embedding, atol=1e-6), side


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": [1.5]}, "input"),
    ({"input": {"text": "x"}}, "input"),
    ({"input": ["ok", 3]}, "input"),
    ({"input": ["x"] * 2049}, "input"),
    ({"input": [[1, 10**7]]}, "input"),
    ({"input": "x", "dimensions": 8}, "dimensions"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "messages": [{"role": "user", "content": "y"}]}, "messages"),
    ({"input": "x", "embed_dtype": "float64"}, "embed_dtype"),
    ({"input": "x", "endianness": "middle"}, "endianness"),
    ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"input": "x", "padding": "max_length"}, "padding"),
    ({"input": "x", "media_io_kwargs": {"image": {}}}, "media_io_kwargs"),
    ({"messages": [[{"role": "user", "content": "y"}]] * 2049}, "messages"),
])
def test_bad_embedding_requests_are_400s_naming_the_field(server, body, param):
    status, out = post(server.url, "/v1/embeddings", body)
    assert status == 400 and out["error"]["param"] == param, out
    status, out = post(server.url, "/v1/embeddings", {"input": "x", "model": "other"})
    assert status == 404 and out["error"]["param"] == "model"


def test_the_key_guards_the_new_routes(server):
    for path in ("/v1/embeddings", "/pooling"):
        status, out = post(server.url, path, {"input": "x"}, key=None)
        assert status == 401 and "API key" in out["error"]["message"]


def test_anthropic_routes_answer_errors_in_anthropics_shape(server):
    for method, path, want in (("GET", "/v1/messages", 405), ("POST", "/v1/messages/nope", 404)):
        status, out = post(server.url, path, {} if method == "POST" else None, method=method)
        assert status == want and out["type"] == "error", out
        assert out["error"]["type"] in ("not_found_error", "invalid_request_error")
    status, out = post(server.url, "/v1/messages", {"model": MODEL, "messages": []})
    assert status == 400 and out["type"] == "error"


# -- an encoder ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    from make_tiny_bert import make_tiny_bert

    out = make_tiny_bert(tmp_path_factory.mktemp("tiny-bert"), "bert", pooling="mean",
                         max_seq_length=64)
    # prompts by input type, as E5-style models name them (no default one: encode adds none)
    (out / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": "query: ", "passage": "passage: "}, "default_prompt_name": None}))
    return out


@pytest.fixture(scope="module")
def bert_server(bert_dir):
    srv = ServerProcess("--model", str(bert_dir), "--served-model-name", "tiny-bert",
                        "--enable-debug-endpoints")
    yield srv
    assert srv.stop() == 0


def test_bert_embeddings_equal_sentence_transformers(bert_server, bert_dir):
    from sentence_transformers import SentenceTransformer

    client = openai.OpenAI(base_url=bert_server.url + "/v1", api_key="unused", max_retries=0)
    out = client.embeddings.create(model="tiny-bert", input=TEXTS, encoding_format="float")
    want = torch.from_numpy(SentenceTransformer(str(bert_dir), device="cpu").encode(TEXTS))
    for row, ref in zip(vectors(out), want):
        assert F.cosine_similarity(row, ref, dim=0) > 1 - 1e-4
    assert client.models.list().data[0].supported_tasks == ["embed", "token_embed"]
    assert client.models.list().data[0].max_model_len == 64  # sentence-transformers' max_seq_length


def test_cohere_input_types_take_the_models_prompts(bert_server):
    import cohere

    co = cohere.ClientV2(api_key="unused", base_url=bert_server.url)
    client = openai.OpenAI(base_url=bert_server.url + "/v1", api_key="unused", max_retries=0)
    for input_type, prefix in (("query", "query: "), ("search_query", "query: "),
                               ("search_document", "passage: ")):
        out = co.embed(model="tiny-bert", texts=TEXTS, input_type=input_type, embedding_types=["float"])
        want = client.embeddings.create(model="tiny-bert", input=[prefix + t for t in TEXTS],
                                        encoding_format="float")
        assert np.allclose(out.embeddings.float_, vectors(want).numpy(), atol=1e-6) and out.texts == TEXTS
    with pytest.raises(cohere.errors.BadRequestError) as info:
        co.embed(model="tiny-bert", texts=TEXTS, input_type="classification", embedding_types=["float"])
    assert "passage, query" in info.value.body["error"]["message"]


def test_an_encoder_refuses_generation_and_over_long_inputs(bert_server):
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})):
        status, out = post(bert_server.url, path, body, key=None)
        assert status == 400 and "embedding model" in out["error"]["message"]
    status, out = post(bert_server.url, "/v1/embeddings", {"input": "word " * 100}, key=None)
    assert status == 400 and out["error"]["param"] == "input"
    status, out = post(bert_server.url, "/v1/embeddings",
                       {"input": "word " * 100, "truncate_prompt_tokens": 64}, key=None)
    assert status == 200 and out["usage"]["prompt_tokens"] == 64


def test_an_encoders_cut_keeps_its_special_tokens(bert_server, bert_dir):
    """truncate_prompt_tokens cuts the text's tokens as Hugging Face tokenizers truncate (the
    end by default, the start with truncation_side "left"), [CLS] and [SEP] kept."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(bert_dir))
    text = " ".join(f"w{i}" for i in range(40))
    for side in ("right", "left"):
        tokenizer.truncation_side = side
        want = tokenizer(text, truncation=True, max_length=12)["input_ids"]
        assert want[0] == tokenizer.cls_token_id and want[-1] == tokenizer.sep_token_id
        status, cut = post(bert_server.url, "/v1/embeddings", {"input": text, "truncate_prompt_tokens": 12,
                                                                "truncation_side": side}, key=None)
        status_ids, by_ids = post(bert_server.url, "/v1/embeddings", {"input": [want]}, key=None)
        assert status == status_ids == 200
        assert np.allclose(cut["data"][0]["embedding"], by_ids["data"][0]["embedding"], atol=1e-6), side


def test_invocations_send_an_encoders_chat_form_to_embeddings(bert_server):
    messages = [{"role": "user", "content": "hello there"}]
    status, out = post(bert_server.url, "/invocations", {"messages": messages}, key=None)
    # routed to /v1/embeddings' chat form (not refused as generation); this tiny BERT has no
    # chat template to render it with
    assert status == 400 and "chat template" in out["error"]["message"], out
    assert "embedding model" not in out["error"]["message"]


def test_per_token_pooling_is_bounded(server):
    status, out = post(server.url, "/pooling", {"input": ["word " * 500] * 200, "task": "token_embed"})
    assert status == 400 and "values" in out["error"]["message"]
