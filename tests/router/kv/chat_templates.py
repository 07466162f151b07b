"""Chat templates the prompt tests render with, beside the tiny model's own (which
takes content as one string and knows nothing of tools)."""

TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|tools|>{% for t in tools %}{{ t | tojson }}{% endfor %}"
    "{{ eos_token }}{% endif %}{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m.name is defined %}({{ m.name }}){% endif %}\n{{ m['content'] }}"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{% for c in m.tool_calls or [] %}<call>{{ c | tojson }}</call>{% endfor %}"
    "{% if m.tool_call_id is defined %}[{{ m.tool_call_id }}]{% endif %}{{ eos_token }}\n"
    "{% endfor %}{% for d in documents or [] %}<doc>{{ d | tojson }}</doc>{% endfor %}"
    "{% if custom_flag is defined %}[flag={{ custom_flag | tojson }}]{% endif %}"
    "{% if enable_thinking is defined %}[think={{ enable_thinking }}]{% endif %}"
    "{% if reasoning_effort is defined %}[effort={{ reasoning_effort }}]{% endif %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
PARTS_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'developer' %}<dev>"
    "{% else %}<|{{ message['role'] }}|>{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}[{{ part['type'] }}:{{ part['text'] }}]"
    "{% endfor %}{% endif %}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
